"""The front ends' signatures are visible to static tools (a misspelt or mistyped argument is flagged in the user's
file by mypy), and the package works where no source is installed (compiled ``.pyc`` files only)."""

import compileall
import inspect
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from torch.nn.parallel import DistributedDataParallel

from lightning_ddp_plus.engine.arguments import ARGUMENT_FIELDS, DDP_FURTHER_ARGUMENTS

ROOT = Path(__file__).resolve().parents[1]

#: The user's view: this package's own sources, the libraries' types left out (they take a minute to analyse and
#: say nothing about the strategy's arguments).
MYPY_CONFIG = """\
[mypy]
follow_imports = silent
ignore_missing_imports = true
[mypy-torch.*,lightning.*,transformers.*,jsonargparse.*,torchmetrics.*,peft.*]
follow_imports = skip
"""

USER_FILE = """\
from lightning_ddp_plus import DDPPlusFabricStrategy, DDPPlusStrategy

strategy = DDPPlusStrategy(bucket_cap_mbb=25, find_unused_parameters="yes")
fabric = DDPPlusFabricStrategy(gradient_accumulation_steps=4, resume_from_last="always")
ported, trainer_kwargs = DDPPlusStrategy.from_training_arguments({}, telemetri=True)
right = DDPPlusStrategy(bucket_cap_mb=25, find_unused_parameters=True, timeout="1h", device_ids=[0])
also_right = DDPPlusFabricStrategy(gradient_accumulation_steps=4, chunk_size="auto")
"""


def run_mypy(folder: Path, source: str) -> list[str]:
    (folder / "mypy.ini").write_text(MYPY_CONFIG)
    (folder / "user_job.py").write_text(source)
    environment = {**os.environ, "MYPYPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            "mypy.ini",
            "--cache-dir",
            str(folder / "cache"),
            "user_job.py",
        ],
        cwd=folder,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return [line for line in done.stdout.splitlines() if ": error:" in line]


def test_mypy_flags_a_misspelt_a_mistyped_and_a_refused_argument_in_a_users_file(tmp_path):
    errors = run_mypy(tmp_path, USER_FILE)
    by_line: dict[int, str] = {}
    for line in errors:
        number = int(line.split(":")[1])
        by_line[number] = by_line.get(number, "") + line
    assert 'Unexpected keyword argument "bucket_cap_mbb"' in by_line[3]
    assert 'did you mean "bucket_cap_mb"' in by_line[3]
    assert 'Argument "find_unused_parameters" to "DDPPlusStrategy" has incompatible type "str"' in by_line[3]
    assert 'Unexpected keyword argument "resume_from_last" for "DDPPlusFabricStrategy"' in by_line[4]
    assert 'Unexpected keyword argument "telemetri"' in by_line[5]
    assert 6 not in by_line and 7 not in by_line


def test_the_typed_keywords_cover_every_argument_of_the_installed_ddp():
    installed = set(list(inspect.signature(DistributedDataParallel.__init__).parameters)[2:])  # self, module
    assert installed - set(ARGUMENT_FIELDS) <= set(DDP_FURTHER_ARGUMENTS)


def test_the_package_imports_and_builds_its_strategies_from_compiled_files_only(tmp_path):
    site = tmp_path / "site"
    shutil.copytree(
        ROOT / "lightning_ddp_plus", site / "lightning_ddp_plus", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "lightning_ddp_plus_rendezvous.py", site)
    assert compileall.compile_dir(site, legacy=True, quiet=1)
    sources = list(site.rglob("*.py"))
    for source in sources:
        source.unlink()
    assert sources and not list(site.rglob("*.py"))
    script = textwrap.dedent(
        """
        import inspect, pydoc
        import lightning_ddp_plus
        from lightning_ddp_plus import DDPPlusFabricStrategy, DDPPlusStrategy
        assert lightning_ddp_plus.__file__.endswith(".pyc"), lightning_ddp_plus.__file__
        strategy = DDPPlusStrategy(process_group_backend="gloo", timeout="1h30m", chunk_size=8)
        assert strategy.timeout.total_seconds() == 5400
        assert DDPPlusFabricStrategy(gradient_accumulation_steps=4).gradient_accumulation_steps == 4
        parameters = inspect.signature(DDPPlusStrategy).parameters
        assert "sync_guard" in parameters and "chunk_size" in parameters
        assert "sync_guard: After every backward" in pydoc.render_doc(DDPPlusStrategy.__init__)
        print("compiled only: ok")
        """
    )
    environment = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled only: ok" in done.stdout
