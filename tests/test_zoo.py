"""The conflict check on real models: tiny Hugging Face ``transformers`` / ``peft`` models (``tests/zoo.py``) trained
by 2 gloo ranks with stock ``DDPStrategy`` (the truth), ``ddp_plus`` defaults and ``checkpointing_conflict="resolve"``,
every run compared with an exact single-process reference.

- Stock's outcome is asserted too, so a torch or Lightning release that changes it is noticed.
- No false alarm: every case stock trains correctly trains to the same parameters with ``ddp_plus``.
- Nothing missed: every case stock gets wrong is refused before any optimizer step, naming the rule and the fix, or
  trained correctly.
- ``resolve`` trains every case to the reference with identical replicas.
"""

import json

import pytest

from tests.helpers import check_in_process, run_case_job
from tests.zoo import MODELS, outcome, zoo_cases

transformers = pytest.importorskip("transformers")
if not transformers.utils.is_torch_available():
    pytest.skip(
        "this transformers release does not support the installed torch (transformers 5 needs torch>=2.6)",
        allow_module_level=True,
    )
pytest.importorskip("peft")

pytestmark = pytest.mark.multiprocess

CASES = zoo_cases()
WARN_CASE = {
    "model": "llama_lora_reentrant",
    "setting": "find_unused-warn",
    "find_unused_parameters": True,
    "runs": ["stock", "warn"],
}


def case_id(case: dict) -> str:
    return f"{case['model']}-{case['setting']}" + (f"-k{case['k']}" if "k" in case else "")


@pytest.fixture(scope="module")
def zoo_results(tmp_path_factory):
    return run_case_job("zoo_job.py", CASES + [WARN_CASE], tmp_path_factory.mktemp("zoo") / "zoo.json", timeout=900)


@pytest.fixture(scope="module")
def zoo(zoo_results):
    return {case_id(result): {run["kind"]: run for run in result["results"]} for result in zoo_results}


def test_the_zoo_covers_what_the_issue_lists():
    families = {name.split("_")[0] for name in MODELS}
    assert families == {"gpt2", "bert", "llama", "vit"}
    assert {"gpt2_reentrant", "gpt2_non_reentrant", "llama_lora_reentrant_no_input_grads"} <= set(MODELS)
    assert sum("k" in case for case in CASES) >= 3
    assert {case["setting"] for case in CASES} == {"default", "find_unused", "static"}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_stock_behaves_as_recorded(zoo, case):
    stock = zoo[case_id(case)]["stock"]
    assert outcome(stock) == case["truth"], (
        stock["error"],
        (stock["message"] or "")[:300],
        stock["max_diff_to_reference"],
    )


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_ddp_plus_defaults_never_false_alarm_and_never_miss(zoo, case):
    runs = zoo[case_id(case)]
    plus = runs["ddp_plus"]
    if case["truth"] == "correct":
        assert outcome(plus) == "correct", (plus["error"], (plus["message"] or "")[:500])
        assert plus["max_diff_to_stock"] == 0.0  # identical to stock: the check changed nothing
        return
    assert outcome(plus) in ("refused", "correct"), (plus["error"], (plus["message"] or "")[:500])
    if outcome(plus) == "refused":
        assert plus["optimizer_steps"] == 0
        assert len(plus["unchanged"]) == plus["trainable"]  # parameters still at their initial values
        assert "Fix:" in plus["message"]
        assert any(f"[{rule}]" in plus["message"] for rule in plus["findings"])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_resolve_trains_every_case_to_the_reference(zoo, case):
    resolve = zoo[case_id(case)]["resolve"]
    assert outcome(resolve) == "correct", (
        resolve["error"],
        (resolve["message"] or "")[:500],
        resolve["max_diff_to_reference"],
    )
    errors = [rule for rule in resolve["findings"] if rule.startswith("R") and rule != "R3"]
    if errors:
        assert len(resolve["resolve_lines"]) == 1, resolve["resolve_lines"]
        line = resolve["resolve_lines"][0]
        assert all(f"[{rule}]" in line for rule in errors) and "->" in line
    else:
        assert resolve["resolve_lines"] == []


def test_r5_silent_no_gradient_is_caught_and_repaired(zoo):
    runs = zoo["llama_lora_reentrant_no_input_grads-find_unused"]
    assert outcome(runs["stock"]) == "wrong" and len(runs["stock"]["unchanged"]) == 8  # 2 layers x q,v x A,B
    assert runs["ddp_plus"]["findings"] == ["R5"] and "enable_input_require_grads()" in runs["ddp_plus"]["message"]
    assert "R5" in runs["resolve"]["findings"] and runs["resolve"]["unchanged"] == []
    assert (
        "made the output of `model.base_model.model.model.embed_tokens` require grad"
        in runs["resolve"]["resolve_lines"][0]
    )


def test_warn_mode_warns_once_per_rule_and_trains_as_stock_does(zoo):
    runs = zoo[case_id(WARN_CASE)]
    warn, stock = runs["warn"], runs["stock"]
    assert warn["rule_warnings"] == ["R1"] and warn["rule_warning_count"] == 1
    assert outcome(warn) == outcome(stock) == "error"
    assert "this is rule R1" in warn["message"]  # torch's own error, annotated with the rule and the fix


ZOO_CONFIG = """
trainer:
  accelerator: cpu
  devices: 2
  logger: false
  strategy:
    class_path: lightning_ddp_plus.DDPPlusStrategy
    init_args: {{find_unused_parameters: {find_unused}}}
model:
  class_path: tests.zoo.ZooModule
  init_args: {{name: {name}}}
"""


@pytest.mark.parametrize(
    ("name", "find_unused", "code", "expected"),
    [
        ("gpt2_reentrant", "true", 1, "ERROR [R1]"),
        ("gpt2_non_reentrant", "true", 0, "ADVICE [A1]"),
        ("bert_unused_pooler", "false", 1, "pooler.dense.weight"),
        ("llama_lora_reentrant_no_input_grads", "true", 1, "ERROR [R5]"),
        ("llama_lora_reentrant", "false", 0, "result: no findings"),
    ],
)
def test_check_command_on_zoo_configs(tmp_path, capsys, name, find_unused, code, expected):
    config = tmp_path / "zoo.yaml"
    config.write_text(ZOO_CONFIG.format(name=name, find_unused=find_unused))
    exit_code, out = check_in_process(config, capsys)  # tests/test_check_command.py runs the console script itself
    assert exit_code == code, out[-3000:]
    assert expected in out
    assert "one probe forward of training_step" in out


def test_zoo_table_script_prints_the_counts(tmp_path, zoo_results, capsys):
    # the table of the runs the zoo job above made (the script's own run is the same job, `run_case_job`)
    from tests.zoo_table import main as zoo_table

    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps(zoo_results))
    out = tmp_path / "zoo.md"
    zoo_table([str(out), "--only", "gpt2_reentrant", "--results", str(runs)])
    text = out.read_text()
    assert "| gpt2_reentrant | find_unused | error |" in text and "false alarms: 0" in text
    cases = sum(case["model"] == "gpt2_reentrant" for case in CASES)
    assert f"cases: {cases}," in text and f"{cases} cases in" in capsys.readouterr().out
