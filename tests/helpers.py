"""Small models, data and callbacks shared by the tests (importable, so the spawn launcher can pickle them)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from tests import warm

REPO_ROOT = Path(__file__).resolve().parent.parent

#: Trainer arguments that keep test runs free of files and console noise.
QUIET_TRAINER = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def regression_data(num_samples: int, features: int = 8, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, features, generator=generator)
    y = x @ torch.randn(features, 1, generator=generator) + 0.1 * torch.randn(num_samples, 1, generator=generator)
    return TensorDataset(x, y)


class TinyRegression(L.LightningModule):
    """Linear -> ReLU -> Linear regression trained with plain SGD (so results are easy to reproduce exactly)."""

    def __init__(
        self, num_samples: int = 64, batch_size: int = 4, lr: float = 0.05, features: int = 8, momentum: float = 0.0
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            regression_data(self.hparams.num_samples, self.hparams.features), batch_size=self.hparams.batch_size
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


class ProcessGroupProbe(L.Callback):
    """Records what the process group really got: its backend and its timeout."""

    def __init__(self) -> None:
        self.backend: str | None = None
        self.timeout_seconds: float | None = None
        self.world_size: int | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.backend = dist.get_backend()
        self.world_size = dist.get_world_size()
        self.timeout_seconds = process_group_timeout().total_seconds()


def process_group_timeout() -> Any:
    group = dist.distributed_c10d._get_default_group()
    return group._get_backend(torch.device("cpu")).options._timeout


class ReplicaReport(L.Callback):
    """At the end of training, gathers every rank's flattened parameters and hook counts; rank 0 writes them as JSON.

    It also records, after every backward (when the all-reduce has finished), whether each gradient is exactly
    representable in float16: true on every step only when an fp16 compression hook really ran.
    """

    def __init__(self, out_path: str) -> None:
        self.out_path = out_path
        self.grads_fp16_exact: list[bool] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.grads_fp16_exact.append(all(torch.equal(g, g.half().float()) for g in grads))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        flat = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        counter = getattr(trainer.strategy, "comm_hook_counter", None)
        local = torch.tensor([counter.calls if counter else -1, int(all(self.grads_fp16_exact)), trainer.global_step])
        stats = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(stats, local)
        if trainer.is_global_zero:
            report = {
                "params": [t.tolist() for t in gathered],
                "hook_calls": [int(s[0]) for s in stats],
                "grads_fp16_exact": [bool(s[1]) for s in stats],
                "global_step": [int(s[2]) for s in stats],
                "backend": dist.get_backend(),
                "timeout_seconds": process_group_timeout().total_seconds(),
                "world_size": dist.get_world_size(),
            }
            Path(self.out_path).write_text(json.dumps(report))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Set in this (pytest) process by earlier in-process Lightning runs; a child that inherits them would believe it is
# already one rank of a launched job and wait for peers that never come.
_LAUNCH_VARIABLES = (
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def clean_environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key not in _LAUNCH_VARIABLES}


def start_process(args: list[str], env: dict[str, str], cwd: Path | str = REPO_ROOT) -> Any:
    """Start ``args`` in a session of its own, its output (stdout and stderr together) as text in ``.stdout``:
    ``python SCRIPT`` from this worker's warm interpreter (``tests/warm.py``) where a fork can be that process, else
    (or with ``DDP_PLUS_FRESH_INTERPRETERS=1``) a fresh one. Either way ``subprocess.Popen``'s interface."""
    if warm.can_fork(args, env) and not os.environ.get("DDP_PLUS_FRESH_INTERPRETERS"):
        return warm.popen(args, env, cwd)
    return subprocess.Popen(
        args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def run_job(
    args: list[str], timeout: float = 180, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run a command in its own session; on time-out kill its whole process group (launched ranks included)."""
    full_env = {**clean_environment(), "MASTER_PORT": str(free_port()), "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    process = start_process(args, full_env, cwd or REPO_ROOT)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        output, _ = process.communicate()
        raise AssertionError(f"job timed out after {timeout}s: {args}\n{output[-4000:]}")
    finally:
        try:
            os.killpg(process.pid, 9)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(args, process.returncode, output, None)


def python_script(name: str) -> list[str]:
    return [sys.executable, str(REPO_ROOT / "tests" / "scripts" / name)]


def console_script(name: str) -> str:
    """The installed console script beside this interpreter (the venv's bin/), whether or not PATH has it."""
    return str(Path(sys.executable).parent / name)


class TinyRegressionManual(TinyRegression):
    """The same model in manual optimization, accumulating with ``strategy.sync_gradients``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.manual_backward(loss)  # the strategy scales by the window length and skips the all-reduce mid-window
        if self.trainer.strategy.sync_gradients:
            optimizer.step()
            optimizer.zero_grad()
        return loss


def start_ranks(
    args: list[str], world_size: int = 2, timeout: float = 300, env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess]:
    """Start ``world_size`` processes of one job ourselves (as torchrun would), so one pair of processes can run
    several ``Trainer.fit`` calls on one process group. Every process is killed at the time limit."""
    port = str(free_port())
    processes = []
    for rank in range(world_size):
        rank_env = {
            **clean_environment(),
            "PYTHONPATH": str(REPO_ROOT),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(world_size),
            **(env or {}),
        }
        processes.append(start_process(args, rank_env))
    results = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(args, process.returncode, output, None))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"ranks timed out after {timeout}s: {args}")
    finally:
        kill_process_groups(processes)
    return results


def kill_process_groups(processes: list[subprocess.Popen]) -> None:
    """SIGKILL each process's whole session (started with ``start_new_session=True``) and reap it."""
    for process in processes:
        try:
            os.killpg(process.pid, 9)
        except ProcessLookupError:
            pass
        process.wait()


class CheckpointNet(L.LightningModule):
    """The reference document's model: Linear -> Norm -> ReLU -> a residual middle block (Linear, Norm, Linear),
    optionally checkpointed and optionally run twice (weight reuse) -> Linear head; optionally an unused Linear."""

    def __init__(
        self,
        checkpointing: str = "none",
        reuse: bool = False,
        unused: bool = False,
        norm: str = "layer",
        num_samples: int = 24,
        batch_size: int = 4,
        lr: float = 0.05,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(1)
        make_norm = nn.LayerNorm if norm == "layer" else nn.BatchNorm1d
        self.inp, self.norm = nn.Linear(8, 16), make_norm(16)
        self.mid = nn.Sequential(nn.Linear(16, 16), make_norm(16), nn.Linear(16, 16))
        self.head = nn.Linear(16, 1)
        self.spare = nn.Linear(16, 16) if unused else None

    def block(self, h: Tensor) -> Tensor:
        if self.hparams.checkpointing == "none":
            return self.mid(h)
        return torch.utils.checkpoint.checkpoint(self.mid, h, use_reentrant=self.hparams.checkpointing == "reentrant")

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.norm(self.inp(x)))
        h = h + self.block(h)
        if self.hparams.reuse:
            h = h + self.block(h)
        return self.head(h)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(self.hparams.num_samples), batch_size=self.hparams.batch_size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def flat_parameters(module: nn.Module) -> Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def reference_parameters(
    model: L.LightningModule, k: int = 1, short_window: str = "mean", world_size: int = 2
) -> Tensor:
    """Single-process reference for a 2-rank run of one epoch: the same model sees every rank's micro-batches
    (Lightning gives each rank a shuffling ``DistributedSampler``, seed 0, epoch 0, for training) and steps SGD once
    per window of k micro-batches with the window's mean gradient (or Lightning's sum / k)."""
    from torch.utils.data import DistributedSampler

    hp = model.hparams
    dataset = regression_data(hp.num_samples)
    x, y = dataset.tensors
    shards = []
    for rank in range(world_size):
        indices = list(DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0))
        shards.append((x[indices], y[indices]))
    batches = len(shards[0][0]) // hp.batch_size
    optimizer = torch.optim.SGD(model.parameters(), lr=hp.lr)
    size = hp.batch_size
    for start in range(0, batches, k):
        window = range(start, min(start + k, batches))
        divisor = len(window) if short_window == "mean" else k
        optimizer.zero_grad()
        total = sum(
            nn.functional.mse_loss(model(xs[size * b : size * (b + 1)]), ys[size * b : size * (b + 1)])
            / divisor
            / world_size
            for b in window
            for xs, ys in shards
        )
        total.backward()
        optimizer.step()
    return flat_parameters(model)


def job_main(run_case: Any) -> None:
    """``main`` of a test job script started on every rank: ``SCRIPT OUT_JSON CASES_JSON`` runs each case on the one
    process group; rank 0 writes the results."""
    out_path, cases = sys.argv[1], json.loads(sys.argv[2])
    results = [run_case(case) for case in cases]
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    gc.collect()  # stock DDPStrategy runs that failed in DDP's forward leave their wrapper in a cycle (see launcher.py)
    dist.destroy_process_group()


def run_case_job(
    script: str,
    cases: list,
    out: Path,
    timeout: float = 400,
    env: dict[str, str] | None = None,
    world_size: int = 2,
) -> list:
    """Start ``script`` on ``world_size`` ranks with ``cases``; every rank must succeed; return rank 0's results."""
    command = python_script(script) + [str(out), json.dumps(cases)]
    for result in start_ranks(command, world_size=world_size, timeout=timeout, env=env):
        assert result.returncode == 0, result.stdout[-4000:]
    return json.loads(out.read_text())


class RankShard(IterableDataset):
    """Rows ``rank::world`` of a data set, as an iterable of unknown length (Lightning shards no iterable itself)."""

    def __init__(self, dataset: TensorDataset, rank: int, world: int) -> None:
        self.dataset, self.rank, self.world = dataset, rank, world

    def __iter__(self) -> Any:
        return (self.dataset[i] for i in range(self.rank, len(self.dataset), self.world))


class IterableDataMixin:
    """Train on ``RankShard``: the epoch's length is unknown to Lightning (``num_training_batches`` is inf)."""

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        shard = RankShard(
            regression_data(self.hparams.num_samples, self.hparams.features), trainer.global_rank, trainer.world_size
        )
        return DataLoader(shard, batch_size=self.hparams.batch_size)


class TinyRegressionIterable(IterableDataMixin, TinyRegression):
    pass


class TinyRegressionManualIterable(IterableDataMixin, TinyRegressionManual):
    pass


def torchrun_command(script: str, *args: object, max_restarts: int = 1) -> list[str]:
    """``torchrun`` (beside this interpreter) running ``tests/scripts/SCRIPT`` on 2 ranks with ``max_restarts``."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    command = [torchrun, "--nproc-per-node", "2", "--max-restarts", str(max_restarts), *rendezvous]
    return [*command, str(REPO_ROOT / "tests" / "scripts" / script), *map(str, args)]


def strategy_outcome(strategy: Any, trainer: L.Trainer) -> dict:
    """What a job case reports of its strategy: optimizer steps, the conflict findings, the settings in effect
    (stock ``DDPStrategy`` has no findings or settings of its own)."""
    stats = getattr(strategy, "sync_stats", None)
    settings = getattr(strategy, "settings", None)
    return {
        "optimizer_steps": stats.optimizer_steps if stats else trainer.global_step,
        "findings": [finding.rule.id for finding in getattr(strategy, "findings", [])],
        "settings": None
        if settings is None
        else {"static_graph": settings.static_graph, "find_unused_parameters": settings.find_unused_parameters},
    }


def mount_unavailable_reason() -> str | None:
    """Why a tmpfs cannot be mounted here (it needs root), or ``None``."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    return None


@contextlib.contextmanager
def small_filesystem(parent: Path, size: str) -> Any:
    """A tmpfs of ``size`` (``mount``'s units, e.g. ``20m``) mounted at a new directory under ``parent``: a small or
    separate filesystem, unmounted and removed on exit, even after an error."""
    mountpoint = Path(tempfile.mkdtemp(prefix="tmpfs-", dir=parent))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)
        mountpoint.rmdir()


def check_in_process(config: Path | str, capsys: Any, *extra: str) -> tuple[int, str]:
    """``ddp-plus check --config CONFIG`` in this process (the console script's own function): its exit status and
    what it printed. One test per command still runs the real console script in a subprocess; the others come here
    to spare a Python start and the imports (seconds each)."""
    from lightning_ddp_plus.diagnostics.check_command import run_check

    environment = dict(os.environ)  # LightningCLI's seed_everything sets PL_GLOBAL_SEED, which later jobs inherit
    capsys.readouterr()
    try:
        code = run_check(["--config", str(config), *extra])
    finally:
        os.environ.clear()
        os.environ.update(environment)
    printed = capsys.readouterr()
    return code, printed.out + printed.err


def tiny_llama(**config: Any) -> nn.Module:
    """A seeded ``LlamaForCausalLM`` built from a small config (no download); ``config`` overrides its fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    fields = {
        "vocab_size": 1000,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        **config,
    }
    return LlamaForCausalLM(LlamaConfig(**fields))


def records(path: Path) -> list[dict]:
    """The JSON lines a job appended to ``path`` as it ran (none if it never wrote)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def times_each_row_trained(run1: dict[int, list[dict]], run2: dict[int, list[dict]], saved: int) -> dict[int, int]:
    """How often each sample was trained across a run cut by a death and its resume: run 1's ``"trained"`` records
    of the steps before the saved one, and every one of run 2's, on every rank."""
    counts: dict[int, int] = {}
    for rank, first in run1.items():
        kept = [r for r in first if r["kind"] == "trained" and r["step_before"] < saved]
        for record in kept + [r for r in run2[rank] if r["kind"] == "trained"]:
            for row in record["rows"]:
                counts[row] = counts.get(row, 0) + 1
    return counts


@contextlib.contextmanager
def process_group_ended_after() -> Any:
    """Around a test's in-process fits: Lightning leaves the process group for a later fit, so the test ends it, and
    the next test in this worker can start its own."""
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
