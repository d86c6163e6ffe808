import pytest
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from lightning_ddp_plus.sync.comm_hooks import CommHook, parse_comm_hook


@pytest.mark.parametrize(
    ("name", "function"),
    [
        ("fp16", default_hooks.fp16_compress_hook),
        ("bf16", default_hooks.bf16_compress_hook),
        ("powersgd", powerSGD_hook.powerSGD_hook),
        ("batched_powersgd", powerSGD_hook.batched_powerSGD_hook),
    ],
)
def test_names_map_to_torch_hooks(name, function):
    assert parse_comm_hook(name).function is function


def test_powersgd_gets_a_default_state():
    state = CommHook.POWERSGD.default_state()
    assert isinstance(state, powerSGD_hook.PowerSGDState)
    assert state.matrix_approximation_rank == 1
    assert CommHook.FP16.default_state() is None


def test_none_and_callables_pass_through():
    assert parse_comm_hook(None) is None
    assert parse_comm_hook("none") is None
    assert parse_comm_hook(default_hooks.allreduce_hook) is default_hooks.allreduce_hook


def test_dotted_path_is_imported():
    assert (
        parse_comm_hook("torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook")
        is default_hooks.fp16_compress_hook
    )


def test_unknown_name_suggests_closest():
    with pytest.raises(ValueError, match=r"ddp_comm_hook='fp61'.*unknown hook name.*did you mean 'fp16'"):
        parse_comm_hook("fp61")


def test_bad_dotted_path():
    with pytest.raises(ValueError, match="could not be loaded"):
        parse_comm_hook("no_such_module.hook")


def test_non_callable_is_refused():
    with pytest.raises(TypeError, match="ddp_comm_hook"):
        parse_comm_hook(42)


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["ddp_plus", "stock"])
def test_powersgd_over_two_buckets_keeps_the_collective_order(variant):
    # PowerSGD issues P's and Q's all-reduces from future callbacks; with two buckets and ranks that reach the second
    # bucket at different moments, the ranks issue collectives in different orders unless the hook keeps them.
    from tests.helpers import python_script, run_job

    result = run_job([*python_script("powersgd_order_job.py"), variant], timeout=240)
    if variant == "ddp_plus":
        assert result.returncode == 0, result.stdout[-3000:]
        assert "TRAINED step=6 replicas_equal=True" in result.stdout
    else:  # the contrast: stock Lightning with torch's hook pairs collectives of different sizes
        assert result.returncode != 0
        assert "TRAINED" not in result.stdout
