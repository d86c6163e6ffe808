"""The engine's components on their own, in one process (no process group): each owns one concern and its state."""

import functools

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from lightning_ddp_plus.conflicts.check import ConflictCheck
from lightning_ddp_plus.conflicts.errors import DDPConflictError
from lightning_ddp_plus.conflicts.rules import CheckedSettings
from lightning_ddp_plus.diagnostics.replicas import ReplicaGuard
from lightning_ddp_plus.sync.accumulation import AccumulationWindow, WindowPosition
from lightning_ddp_plus.sync.comm_hooks import CommHook, HookAssembly
from tests.helpers import CheckpointNet


def same(facts):
    return facts  # one process: nothing to agree with


def checked(mode: str, model: nn.Module, view: CheckedSettings, x: torch.Tensor = None):
    """Attach a check to ``model`` (as it would to a wrapper), run one training forward, decide."""
    warnings, infos = [], []
    check = ConflictCheck(mode, warn=warnings.append, info=infos.append)
    check.attach(model, model)
    loss = model(torch.randn(4, 8) if x is None else x).pow(2).mean()
    return check, check.decide(loss, view, same) if check.pending else view, warnings, infos, loss


def test_error_mode_raises_with_rule_and_fix():
    with pytest.raises(DDPConflictError, match=r"\[R1\].*Fix: set static_graph=True") as raised:
        checked("error", CheckpointNet(checkpointing="reentrant"), CheckedSettings(find_unused_parameters=True))
    assert [f.rule.id for f in raised.value.findings] == ["R1"]


def test_warn_mode_warns_once_per_rule_and_keeps_the_settings():
    check, view, warnings, infos, _ = checked(
        "warn", CheckpointNet(checkpointing="reentrant", unused=True), CheckedSettings(find_unused_parameters=True)
    )
    assert view == CheckedSettings(find_unused_parameters=True)
    assert [w.split("]")[0] for w in warnings] == ["DDPPlusStrategy: [R1"] and infos == []
    assert not check.pending  # decided once; later forwards are not observed


def test_resolve_mode_returns_working_settings_and_logs_them():
    _, view, _, infos, _ = checked("resolve", CheckpointNet(checkpointing="reentrant", reuse=True), CheckedSettings())
    assert view.static_graph is True
    assert len(infos) == 1 and "[R2]" in infos[0] and "static_graph: False -> True" in infos[0]


def test_off_mode_observes_nothing():
    check = ConflictCheck("off", warn=print, info=print)
    check.attach(nn.Linear(2, 2), nn.Linear(2, 2))
    assert not check.pending


class FrozenStem(nn.Module):
    """A frozen input layer feeding a reentrant region with trainable parameters (R5)."""

    def __init__(self, feeds_region_directly: bool = True):
        super().__init__()
        self.stem, self.block, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.stem.requires_grad_(False)
        self.direct = feeds_region_directly

    def forward(self, x):
        h = self.stem(x)
        if not self.direct:
            h = h * 2  # not a module's output: no module to hook
        return self.head(torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True))


def test_r5_resolved_by_hooking_the_module_that_feeds_the_region():
    model = FrozenStem()
    check, view, _, infos, loss = checked("resolve", model, CheckedSettings(find_unused_parameters=True))
    assert view.repair_input_grads and view.static_graph  # R5, then R1 on the repaired facts
    assert "made the output of `stem` require grad" in infos[0]
    loss.backward()
    assert model.block.weight.grad is not None  # the observed forward itself was repaired
    # the fix holds in the next forward (checked once more), and is removed at the end of the fit
    loss = model(torch.randn(4, 8)).sum()
    assert check.pending and check.decide(loss, view, same) == view
    assert model.stem(torch.randn(1, 8)).requires_grad
    check.detach()
    assert not model.stem(torch.randn(1, 8)).requires_grad


def test_r5_refused_when_no_safe_fix_exists():
    with pytest.raises(DDPConflictError, match=r"(?s)\[R5\].*'resolve' found no safe fix"):
        checked("resolve", FrozenStem(feeds_region_directly=False), CheckedSettings())


def test_window_decides_sync_scale_and_position():
    window = AccumulationWindow(steps=3, short_window="mean")
    assert window.reconcile(trainer_steps=1) == 3
    assert window.must_sync_first_backward(static_graph=True) and not window.must_sync_first_backward(
        static_graph=False
    )
    assert window.syncs(WindowPosition(0, 3), static_graph=True)  # R3: the run's first backward syncs
    window.record_backward(synced=True)
    assert not window.syncs(WindowPosition(0, 3), static_graph=True)
    assert window.loss_scale(WindowPosition(0, 2), divided_by_steps=False) == 0.5
    positions = []
    for is_last in (False, False, False, False, True):
        position = window.peek(is_last=is_last)
        window.advance(position)
        positions.append((position.index, position.closes_window))
    assert positions == [(0, False), (1, False), (2, True), (0, False), (1, True)]
    window.reset()
    assert window.stats.synced_backwards == 0 and window.must_sync_first_backward(static_graph=True)


def test_guard_cadence():
    guard = ReplicaGuard(every_n_steps=3)
    model = nn.Linear(2, 2)
    guard.attach(model, model, with_buffers=False)
    due = []
    for step in range(1, 8):
        guard.step_done(step)
        due.append(guard._due_step)
        guard._due_step = None
    assert due == [None, None, 3, None, None, 6, None]
    guard.detach()
    assert not model._forward_pre_hooks


def test_hook_assembly_gives_powersgd_a_fresh_default_state_per_wrapper():
    assembly = HookAssembly(CommHook.POWERSGD, state=None, wrapper=None)
    registered = []
    fake_wrapper = type("W", (), {"register_comm_hook": lambda self, state, hook: registered.append((state, hook))})()
    assembly.register(fake_wrapper)
    assembly.register(fake_wrapper)
    (first, hook), (second, _) = registered
    assert isinstance(first, powerSGD_hook.PowerSGDState) and first is not second
    assert first.matrix_approximation_rank == 1 and first.start_powerSGD_iter == 2
    # counted, and kept in bucket order (PowerSGD issues collectives from callbacks)
    assert hook.__qualname__ == "counted(bucket_ordered(powerSGD_hook))" and assembly.name == "powersgd"
    custom = HookAssembly(functools.partial(print), state="s", wrapper=None)
    assert custom.name.startswith("functools.partial") or custom.name


def test_ddp_is_built_on_a_side_stream_of_the_models_own_device(monkeypatch):
    """With the CUDA device faked (no GPU here): the stream is made for the named device, not the current one."""
    from contextlib import nullcontext

    from lightning_ddp_plus.sync.wrapper import wrapping_stream

    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: made.append(device) or f"stream on {device}")
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: nullcontext(stream))
    with wrapping_stream(torch.device("cuda", 3), [3]) as stream:
        assert stream == "stream on cuda:3"
    assert made == [torch.device("cuda", 3)]
    assert isinstance(wrapping_stream(torch.device("cpu"), None), nullcontext)
