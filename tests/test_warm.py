"""A job process forked from the warm interpreter (``tests/warm.py``) is the process ``python SCRIPT ARGS`` would be,
in what the jobs and their tests rely on."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests import warm
from tests.helpers import REPO_ROOT, clean_environment, start_process

pytestmark = pytest.mark.multiprocess

PROBE = textwrap.dedent(
    """
    import json, os, sys
    report = {
        "argv": sys.argv, "cwd": os.getcwd(), "only_here": os.environ.get("ONLY_HERE"),
        "unset": os.environ.get("WARM_TEST_UNSET"), "session_leader": os.getsid(0) == os.getpid(),
        "cmdline": open(f"/proc/{os.getpid()}/cmdline", "rb").read().rstrip(b"\\0").split(b"\\0")[1:],
        "path0": sys.path[0], "name": __name__, "stdin": sys.stdin.read(),
    }
    report["cmdline"] = [part.decode() for part in report["cmdline"]]
    print(json.dumps(report), flush=True)
    if sys.argv[1] == "raise":
        raise ValueError("raised in the script")
    if sys.argv[1] == "hang":
        import time
        time.sleep(600)
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.fixture
def probe(tmp_path, monkeypatch):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    monkeypatch.setenv("WARM_TEST_UNSET", "in the test process only")
    env = {**clean_environment(), "PYTHONPATH": str(REPO_ROOT), "ONLY_HERE": "yes"}
    del env["WARM_TEST_UNSET"]
    return [sys.executable, str(script)], env, tmp_path


def test_a_script_runs_as_its_own_process_with_its_argv_environment_folder_and_exit_code(probe):
    command, env, folder = probe
    assert warm.can_fork([*command, "3"], env)
    process = start_process([*command, "3"], env, folder)
    output, _ = process.communicate(timeout=60)
    report = json.loads(output.splitlines()[-1])
    assert isinstance(process, warm.WarmProcess)
    assert process.returncode == 3
    assert report["argv"] == [command[1], "3"]
    assert report["cmdline"] == [command[1], "3"]  # what pgrep -f and /proc/PID/cmdline show
    assert report["cwd"] == str(folder)
    assert report["only_here"] == "yes"
    assert report["unset"] is None
    assert report["session_leader"]
    assert report["path0"] == str(folder)
    assert report["name"] == "__main__"
    assert report["stdin"] == ""


def test_an_uncaught_exception_is_printed_by_the_excepthook_and_exits_1(probe):
    command, env, folder = probe
    process = start_process([*command, "raise"], env, folder)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 1
    assert "ValueError: raised in the script" in output
    assert "Traceback (most recent call last)" in output


def test_a_killed_process_reports_the_signal_and_keeps_what_it_printed_across_a_time_out(probe):
    command, env, folder = probe
    process = start_process([*command, "hang"], env, folder)
    with pytest.raises(subprocess.TimeoutExpired):
        process.communicate(timeout=3)
    os.killpg(process.pid, signal.SIGKILL)
    output, _ = process.communicate(timeout=30)
    assert process.returncode == -signal.SIGKILL
    assert '"argv"' in output


@pytest.mark.parametrize(
    ("command", "extra"),
    [
        (["-c", "print(1)"], {}),
        (["-m", "pytest"], {}),
        (["probe.py"], {"MALLOC_ARENA_MAX": "1"}),  # read by the C library when it loads
        (["probe.py"], {"PYTHONPATH": "/elsewhere"}),
    ],
)
def test_what_a_fork_cannot_be_starts_a_fresh_interpreter(command, extra):
    env = {**clean_environment(), "PYTHONPATH": str(REPO_ROOT), **extra}
    assert not warm.can_fork([sys.executable, *command], env)
