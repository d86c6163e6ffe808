"""Construction-time and Trainer-time validation of ``DDPPlusStrategy``: no process is started in this file."""

import os
import warnings
from datetime import timedelta

import lightning as L
import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import lightning_ddp_plus
from lightning_ddp_plus import REGISTERED_NAMES, DDPPlusStrategy
from lightning_ddp_plus.sync.comm_hooks import CommHook
from lightning_ddp_plus.sync.wrapper import HAS_FORWARD_SYNC_BUFFERS


def test_is_a_lightning_ddp_strategy_with_documented_defaults():
    strategy = DDPPlusStrategy()
    assert isinstance(strategy, DDPStrategy)
    assert strategy.timeout == timedelta(seconds=1800)
    assert strategy.settings.find_unused_parameters is False
    # torch's default bucket size, left unset as stock leaves it: an explicit 25 would drop torch's 1 MiB first bucket
    assert strategy.settings.bucket_cap_mb is None and "bucket_cap_mb" not in strategy._ddp_kwargs
    assert strategy.settings.broadcast_buffers is True
    assert strategy.settings.static_graph is False
    assert strategy.settings.gradient_as_bucket_view is False
    assert strategy.comm_hook is None
    assert strategy.start_method == "popen"


def test_every_knob_reaches_the_ddp_kwargs():
    # torch 2.13 takes `forward_sync_buffers` (and `batched_grad_copy`); older releases `broadcast_buffers`
    extra = {"batched_grad_copy": True} if HAS_FORWARD_SYNC_BUFFERS else {"dim": 0}
    strategy = DDPPlusStrategy(
        find_unused_parameters=True,
        bucket_cap_mb=50,
        broadcast_buffers=False,
        static_graph=True,
        gradient_as_bucket_view=True,
        **extra,
    )
    assert strategy._ddp_kwargs == {
        "find_unused_parameters": True,
        "bucket_cap_mb": 50,
        ("forward_sync_buffers" if HAS_FORWARD_SYNC_BUFFERS else "broadcast_buffers"): False,
        "static_graph": True,
        "gradient_as_bucket_view": True,
        **extra,
    }


def test_timeout_and_hook_are_parsed():
    strategy = DDPPlusStrategy(process_group_backend="gloo", timeout="30m", ddp_comm_hook="fp16")
    assert strategy.timeout == timedelta(minutes=30)
    assert strategy.comm_hook is CommHook.FP16


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"process_group_backend": "ncll"}, ValueError, "did you mean 'nccl'"),
        ({"timeout": 0}, ValueError, r"`timeout=0`.*greater than zero"),
        ({"timeout": "-1h"}, ValueError, "could not be read"),
        ({"timeout": "later"}, ValueError, "could not be read"),
        ({"bucket_cap_mb": 0}, ValueError, r"`bucket_cap_mb=0`.*greater than zero"),
        ({"bucket_cap_mb": -25}, ValueError, "bucket_cap_mb"),
        ({"bucket_cap_mb": "25"}, TypeError, r"bucket_cap_mb.*expected a positive number"),
        ({"find_unused_parameters": "false"}, TypeError, r"find_unused_parameters='false'.*True or False"),
        ({"static_graph": 1}, TypeError, "static_graph"),
        ({"broadcast_buffers": None}, TypeError, "broadcast_buffers"),
        ({"gradient_as_bucket_view": "yes"}, TypeError, "gradient_as_bucket_view"),
        ({"ddp_comm_hook": "fp61"}, ValueError, "did you mean 'fp16'"),
        ({"ddp_comm_hook": "powrsgd"}, ValueError, "did you mean 'powersgd'"),
        ({"start_method": "thread"}, ValueError, "start_method"),
        ({"model_averaging_period": 0}, ValueError, "model_averaging_period"),
        ({"find_unused_parameter": True}, TypeError, "did you mean `find_unused_parameters`"),
        ({"forward_sync_buffers": False}, ValueError, "use the `broadcast_buffers` argument"),
        ({"device_ids": [0]}, ValueError, "device_ids"),
        ({"ddp_comm_wrapper": print}, ValueError, "needs a hook to wrap"),
    ],
)
def test_bad_values_fail_at_construction(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        DDPPlusStrategy(**kwargs)


def test_registered_names_resolve_to_the_strategy_with_their_launcher():
    assert {name for name, _ in REGISTERED_NAMES} == {
        "ddp_plus",
        "ddp_plus_spawn",
        "ddp_plus_fork",
        "ddp_plus_notebook",
    }
    for name, start_method in REGISTERED_NAMES:
        strategy = StrategyRegistry.get(name)
        assert type(strategy) is DDPPlusStrategy
        assert strategy.start_method == start_method


def test_registration_is_idempotent():
    DDPPlusStrategy.register_strategies(StrategyRegistry)
    DDPPlusStrategy.register_strategies(StrategyRegistry)
    assert StrategyRegistry.get("ddp_plus").start_method == "popen"
    import importlib

    importlib.reload(lightning_ddp_plus)
    assert type(StrategyRegistry.get("ddp_plus_spawn")) is lightning_ddp_plus.DDPPlusStrategy


def trainer(strategy, accelerator="cpu", devices=2):
    return L.Trainer(
        strategy=strategy, accelerator=accelerator, devices=devices, logger=False, enable_progress_bar=False
    )


def test_trainer_string_gets_auto_backend_for_cpu():
    assert trainer("ddp_plus").strategy.process_group_backend == "gloo"


def test_nccl_on_cpu_fails_at_trainer_construction():
    with pytest.raises(
        ValueError, match=r"'nccl' cannot run collectives on 'cpu' devices.*set `process_group_backend` to 'gloo'"
    ):
        trainer(DDPPlusStrategy(process_group_backend="nccl"))


def test_xccl_without_xpus_fails_at_trainer_construction():
    with pytest.raises(ValueError, match=r"'xccl' cannot run collectives on 'cpu' devices"):
        trainer(DDPPlusStrategy(process_group_backend="xccl"))


class FakeCUDAAccelerator(CPUAccelerator):
    """Claims CUDA devices so the device-dependent choices can be checked on a CPU machine; nothing runs on them."""

    @staticmethod
    def get_parallel_devices(devices):
        return [torch.device("cuda", i) for i in range(int(devices))]

    @staticmethod
    def is_available() -> bool:
        return True

    def setup_device(self, device: torch.device) -> None:
        """Nothing to set up: no kernel runs on the claimed devices."""


def test_gloo_is_accepted_on_cuda_devices():
    strategy = trainer(DDPPlusStrategy(process_group_backend="gloo"), accelerator=FakeCUDAAccelerator()).strategy
    assert strategy.process_group_backend == "gloo"
    assert strategy.parallel_devices[0].type == "cuda"


def test_auto_on_cuda_picks_nccl_and_checks_it_before_the_group_is_created():
    # As stock Lightning: a faked CUDA accelerator builds (Lightning's own tests rely on it); whether this torch has
    # NCCL is checked in each process right before the process group would be created.
    built = trainer(DDPPlusStrategy(), accelerator=FakeCUDAAccelerator())
    assert built.strategy.process_group_backend == "nccl"
    if not torch.distributed.is_nccl_available():
        with pytest.raises(ValueError, match=r"`process_group_backend='nccl'`.*has no 'nccl' backend"):
            built.strategy.setup_distributed()
        assert not torch.distributed.is_initialized()


def test_a_named_backend_missing_from_this_torch_fails_at_trainer_construction():
    missing = next((name for name in ("mpi", "ucc") if not torch.distributed.is_backend_available(name)), None)
    if missing is None:
        pytest.skip("this torch build has both MPI and UCC")
    with pytest.raises(ValueError, match=f"has no '{missing}' backend"):
        trainer(DDPPlusStrategy(process_group_backend=missing), accelerator=CPUAccelerator())


def test_xccl_on_cuda_devices_is_refused():
    with pytest.raises(ValueError, match="'xccl' cannot run collectives on 'cuda' devices"):
        trainer(DDPPlusStrategy(process_group_backend="xccl"), accelerator=FakeCUDAAccelerator())


def test_broadcast_buffers_maps_without_deprecation_warning(monkeypatch):
    # The mapped kwargs are what torch receives; constructing DDP with them must not warn about broadcast_buffers.
    import torch.distributed as dist

    from lightning_ddp_plus.processes.launcher import register_process_group_shutdown
    from tests.helpers import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    # Held until exit, as the strategy holds its group: dropping the group's last reference right after DDP's
    # broadcast deadlocked once (the main thread joined a gloo worker that waited for the GIL to free the broadcast).
    register_process_group_shutdown()
    try:
        for value in (True, False):
            kwargs = DDPPlusStrategy(broadcast_buffers=value)._ddp_kwargs
            with warnings.catch_warnings():
                warnings.simplefilter("error", FutureWarning)
                ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.BatchNorm1d(3), **kwargs)
            assert ddp.broadcast_buffers is value
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("message", "explained"),
    [
        (
            "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 6000ms for recv operation to complete",
            True,
        ),
        (
            "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.",
            True,
        ),
        ("DataLoader timed out after 5 seconds", False),
        ("Timeout while reading the config file", False),
    ],
)
def test_timeout_explanation_only_for_collective_timeouts(message, explained):
    error = RuntimeError(message)
    DDPPlusStrategy(timeout="6s").on_exception(error)
    assert ("set by `DDPPlusStrategy(timeout=...)`" in str(error)) is explained
    assert str(error).startswith(message)  # the original message is kept


def test_reducer_errors_get_their_rule():
    error = RuntimeError("Expected to mark a variable ready only once. ... marked as ready twice")
    DDPPlusStrategy().on_exception(error)
    assert "this is rule R1" in str(error) and "Fix: set static_graph=True" in str(error)


def test_a_timeout_before_the_first_step_names_setup_timeout_and_after_it_timeout():
    """Before the first training step the group waits `setup_timeout` (when given), and a timeout there says so."""
    message = "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv operation to complete"
    in_setup = RuntimeError(message)
    DDPPlusStrategy(timeout="3s", setup_timeout="2h").on_exception(in_setup)
    assert "timeout (2h, set by `DDPPlusStrategy(setup_timeout=...)`)" in str(in_setup)
    assert "raise `setup_timeout` only if that rank is legitimately slow" in str(in_setup)
    plain = RuntimeError(message)
    DDPPlusStrategy(timeout="3s").on_exception(plain)
    assert "(3s, set by `DDPPlusStrategy(timeout=...)`)" in str(plain)
    assert "raise `setup_timeout` rather than `timeout`" in str(plain)


FLIGHT_RECORDER_VARIABLES = (
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
)


def test_on_nccl_the_stall_report_turns_on_nccls_flight_recorder_and_the_timeout_says_where_it_dumped(monkeypatch):
    for name in FLIGHT_RECORDER_VARIABLES:
        monkeypatch.delenv(name, raising=False)  # and restored as they were afterwards
    strategy = trainer(DDPPlusStrategy(timeout="10m"), accelerator=FakeCUDAAccelerator()).strategy
    assert strategy.process_group_backend == "nccl"
    if not torch.distributed.is_nccl_available():  # the real path: set in each process, right before the group
        with pytest.raises(ValueError, match="has no 'nccl' backend"):
            strategy.setup_environment()
        assert not torch.distributed.is_initialized()
        assert "TORCH_FR_BUFFER_SIZE" not in os.environ  # the backend is checked first
    strategy.engine.prepare_process_group(strategy.process_group_backend, os.environ)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == "/tmp/nccl_trace_rank_"
    error = RuntimeError(
        "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 600000 "
        "milliseconds before timing out."
    )
    strategy.on_exception(error)
    assert "set by `DDPPlusStrategy(timeout=...)`" in str(error)
    assert "NCCL flight recorder on (the last 2000 collectives per rank; dumped on a timeout to " in str(error)
    assert "/tmp/nccl_trace_rank_<rank>; read with `python -m torch.distributed.flight_recorder.fr_trace" in str(error)


def fabric_on_faked_cuda():
    from lightning.fabric.accelerators import CPUAccelerator as FabricCPUAccelerator
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_ddp_plus import DDPPlusFabricStrategy

    class FakeCUDA(FabricCPUAccelerator):
        def setup_device(self, device: torch.device) -> None:
            """Nothing to set up: no kernel runs on the claimed device."""

    return DDPPlusFabricStrategy(
        accelerator=FakeCUDA(),
        parallel_devices=[torch.device("cuda", 0)],
        cluster_environment=LightningEnvironment(),
    )


FRONT_ENDS_ON_FAKED_CUDA = {
    "Trainer": lambda: trainer(DDPPlusStrategy(), accelerator=FakeCUDAAccelerator()).strategy,
    "Fabric": fabric_on_faked_cuda,
}


@pytest.mark.parametrize("front_end", FRONT_ENDS_ON_FAKED_CUDA)
def test_the_flight_recorders_variables_are_gone_after_teardown_and_a_failed_setup_sets_none(front_end, monkeypatch):
    # Lightning's Fabric tests check that no test leaves variables in the environment: the user's process (rank 0)
    # must get back what it had, whether the fit ended or its setup failed.
    for name in FLIGHT_RECORDER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")  # the user's own: kept
    strategy = FRONT_ENDS_ON_FAKED_CUDA[front_end]()
    if not torch.distributed.is_nccl_available():
        with pytest.raises(ValueError, match="has no 'nccl' backend"):
            strategy.setup_environment()
        assert {name for name in FLIGHT_RECORDER_VARIABLES if name in os.environ} == {"TORCH_NCCL_DUMP_ON_TIMEOUT"}
    strategy.engine.prepare_process_group("nccl", os.environ)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    strategy.teardown()
    assert {name for name in FLIGHT_RECORDER_VARIABLES if name in os.environ} == {"TORCH_NCCL_DUMP_ON_TIMEOUT"}
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


@pytest.mark.parametrize(
    ("backend", "arguments", "environ", "expected"),
    [
        ("gloo", {}, {}, {}),  # gloo has no flight recorder
        ("nccl", {"stall_report_after": None}, {}, {}),  # the stall report off: nothing of it
        ("nccl", {}, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}),  # the user's off
        (
            "nccl",
            {},
            {"TORCH_FR_BUFFER_SIZE": "64", "TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr_"},
            {
                "TORCH_FR_BUFFER_SIZE": "64",
                "TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr_",
                "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # the one variable the user left unset
            },
        ),
    ],
)
def test_the_flight_recorder_keeps_what_the_user_set(backend, arguments, environ, expected):
    engine = DDPPlusStrategy(**arguments).engine
    engine.prepare_process_group(backend, environ)
    assert environ == expected
