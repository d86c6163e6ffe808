"""The keyword arguments of the front ends, generated from ``DDPPlusArguments`` (``engine/arguments.py``) by
``python docs/generated.py``: do not edit by hand (``tests/test_generated.py`` fails when it is stale).

Type checkers and IDEs read each front end's arguments from these ``TypedDict``s (``**arguments:
Unpack[DDPPlusStrategyKeywords]``), so a misspelt or mistyped argument is flagged in the user's editor;
``ARGUMENT_DOCS`` gives ``help()`` and LightningCLI each argument's docstring without reading the source.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, TypedDict

from lightning_ddp_plus.config.timeout import TimeoutLike
from lightning_ddp_plus.conflicts.check import ConflictMode
from lightning_ddp_plus.persistence.resume import ResumeMode
from lightning_ddp_plus.persistence.world_size import WorldSizeChange
from lightning_ddp_plus.processes.launcher import StartMethod
from lightning_ddp_plus.sharding.optimizer import OptimizerSharding
from lightning_ddp_plus.sync.accumulation import ShortWindow
from lightning_ddp_plus.sync.uneven import UnevenInputs


class _Shared(TypedDict, total=False):
    """The arguments every front end takes."""

    setup_timeout: TimeoutLike | None
    """How long a collective may wait from the process group's creation to the first training step: the ranks waiting while rank 0 prepares data or loads a large model. The first training forward sets the group's timeout to ``timeout`` (and the end of the fit back), so a stuck step is not waited for as long. The same forms as ``timeout``; ``None`` (default): ``timeout`` throughout. Needs a gloo or NCCL process group."""

    gradient_as_bucket_view: bool
    """Make gradients views into the communication buckets (saves memory)."""

    ddp_comm_hook: str | Callable[..., Any] | None
    """``"fp16"``, ``"bf16"``, ``"powersgd"``, ``"batched_powersgd"``, a dotted import path to a hook function, or a callable ``hook(state, bucket)``. Registered on every backend, gloo included."""

    ddp_comm_state: object | None
    """State passed to the hook; PowerSGD gets a default state when this is ``None``."""

    ddp_comm_wrapper: Callable[..., Any] | None
    """Wrapper applied to the hook, e.g. torch's ``fp16_compress_wrapper``."""

    chunk_size: int | Literal["auto"] | None
    """Rows per chunk: each training batch is split along its first dimension into chunks of this many rows, each runs forward and backward with its loss weighted by its share of the rows, only the last one all-reduces, and one optimizer step follows the batch: the global batch, the schedule and ``global_step`` stay as they are. It multiplies with accumulation. ``"auto"``: start with the whole batch; when any rank runs out of memory in a forward or backward, every rank drops the batch's gradients, halves the size and runs the batch again, and keeps the size that held (logged once, saved in checkpoints). ``None`` (default): the whole batch; an out-of-memory error on one rank then ends every rank with an error that names it. Automatic optimization only."""

    short_window: ShortWindow
    """How the short last window of an epoch is averaged. ``"mean"`` (default): the mean over the micro-batches it really had. ``"lightning"``: Lightning's rule, the sum divided by k."""

    checkpointing_conflict: ConflictMode
    """What to do when the DDP settings conflict with the model (gradient checkpointing, reused or unused parameters; see the rule table in the docs' conflict checks guide). The first training forward is observed and the decision taken at the first backward: ``"error"`` (default) raises ``DDPConflictError`` before any gradient is all-reduced or any optimizer step runs; ``"warn"`` warns once per rule and trains as stock DDP would; ``"resolve"`` changes the settings (and, for rule R5, the model's input grads) to a working combination and logs what changed; ``"off"`` checks nothing at the first forward. For what the per-step guard finds later (rule R6), ``"resolve"`` and ``"warn"`` switch ``find_unused_parameters`` on and train on with that step's gradients averaged; ``"error"`` and ``"off"`` raise."""

    verify_replicas_every_n_steps: int | None
    """Every N optimizer steps, check that all ranks hold identical parameters (and buffers, when ``broadcast_buffers`` is on); a mismatch stops training with ``ReplicaDriftError`` naming the tensor, the ranks and the step. ``None`` (default): off."""

    telemetry: bool
    """Record, per optimizer step, buckets all-reduced, bytes sent, synced and skipped backward passes and torch's timings of forward, backward compute, communication and overlap, logged under ``ddp/`` (with the Trainer, adds the ``DDPTelemetry`` callback)."""

    start_method: StartMethod
    """How processes are started: ``"popen"`` (re-run the script), ``"spawn"``, ``"fork"``, ``"forkserver"``."""

    preemption_signals: Sequence[str]
    """The signals that mean "save and stop" (a termination notice): SIGTERM (default: Kubernetes, torchrun's agent, SLURM at the time limit), SIGUSR1/SIGUSR2 for SLURM's ``--signal=SIGUSR1@90``; ``[]``: off (Lightning's own handling, as stock). The handler only records the notice; every rank stops after the same optimizer step (at most one step after the notice, a window of accumulation finished), the Trainer saves it atomically where ``ckpt_path="last"`` finds it, and ``fit`` raises ``Preempted`` (a ``SIGTERMException``; exit code 128 + the signal's number). Its flag rides in the last gradient bucket, so a run without a notice pays nothing (with PowerSGD's or a user's ``ddp_comm_hook``, or ``optimizer_sharding="overlap"``: in ``sync_guard``'s all-reduce). With Fabric, ask ``strategy.preemption_agreed`` after the optimizer step (the preemption guide)."""

    sync_guard: bool
    """After every backward that should synchronize, check on every rank that torch's reducer all-reduced every bucket, and act before the optimizer step (rule R6): no optimizer step is ever applied with gradients that were not all-reduced, and a parameter unused on some ranks only ends the step with an error instead of a hang. The ranks agree with a few integers appended to the last gradient bucket, on every backend: no message or store call of its own (with ``optimizer_sharding=True``, appended to the last bucket's reduce-scatter; with ``ddp_comm_hook="fp16"`` or ``"bf16"``, to its last compressed bucket). With PowerSGD's or a user's ``ddp_comm_hook``, a ``ddp_comm_wrapper`` or ``optimizer_sharding="overlap"`` (the buckets are theirs), one all-reduce of a few integers per step on a small gloo group of their own. Default on."""

    uneven_inputs: UnevenInputs
    """Ranks whose shards hold different numbers of batches (an ``IterableDataset`` split by rank, ``use_distributed_sampler=False``): ``"error"`` (default) raises ``UnevenInputsError`` on every rank at the first batch that is one rank's last and not another's, naming the counts; ``"stop"`` ends the epoch on every rank there and reports, once per epoch, the batches left untrained; ``"join"`` lets the longer ranks train on while the others repeat their last batch with weight 0, the gradient being the mean over the batches really trained. Nothing is compared when every training loader has a ``DistributedSampler`` (even by construction). With Fabric it needs ``strategy.micro_batches(loader)``."""

    atomic_checkpoints: bool
    """Write every checkpoint to a temporary file beside its target, fsync it, rename it over the target and fsync the directory, so a kill, a full disk or a node crash during a save leaves the previous file whole. A checkpoint IO you pass stays yours, as passed: Lightning's own ``TorchCheckpointIO`` is saved atomically, another class is left to save as it saves (said once; wrap it in ``AtomicCheckpointIO`` yourself to make its saves atomic). Default on."""

    optimizer_sharding: OptimizerSharding
    """ZeRO stage 1, each rank keeping the optimizer state of 1/N of the model. ``True``: each gradient bucket is reduce-scattered during the backward, each rank steps its chunk of every bucket (padded to a multiple of the world size), and the updated parameters are all-gathered: the bytes of DDP's all-reduce, exact, on every backend (on gloo through pairwise exchanges); refused with ``ddp_comm_hook`` (it is the hook). ``"all_reduce"``: torch's ``ZeroRedundancyOptimizer`` after the full all-reduce, whole parameters per rank, the updated parameters broadcast (1.5x DDP's bytes); the one to pick with a compressing comm hook. ``"overlap"`` runs that step inside the backward with torch's ``hook_with_zero_step`` (NCCL/HCCL only: refused on gloo before launch; torch applies no update in the first 2 steps, 3 with ``static_graph``; refused with a comm hook, accumulation, ``bucket_cap_mb="auto"``, ``sync_guard``, ``uneven_inputs="join"`` and gradient clipping). Checkpoints hold the consolidated, plain optimizer state (gathered on rank 0 at each save). Default ``False``."""

    stall_report_after: TimeoutLike | Literal["auto"] | None
    """How long a collective may be waited in before the ranks compare what they are doing, through the job's store, and say why: ranks out of step (a collective issued on some ranks only, e.g. ``self.log(..., sync_dist=True)`` on one rank) end the job at once with each rank's collective and line; a rank that has not reached the collective is named with its line and stack, and the collective timeout's error carries the same report. ``"auto"`` (default): a quarter of ``timeout``, at most 5 minutes. ``None``: off. The same forms as ``timeout``, and shorter than it."""

    ledger_length: int
    """The collectives each rank remembers (its collective ledger), for the stall report. ``0``: none (the ledger is off), which needs ``stall_report_after=None``."""

    find_stragglers_every_n_steps: int | None
    """Every N optimizer steps, the ranks compare their median time per step in data fetch, compute (less the time waited in collectives), collective wait and optimizer step (one gather of five integers per rank: the medians and the steps they cover), and a rank the others wait for gets one warning (repeated at most every 5 minutes) naming it, the phase and the figures. ``None``: off."""

    micro_batch_size: int | Literal["auto"] | None
    """Deprecated since 0.2.0: the former name of ``chunk_size``, which see."""


class _Ported(TypedDict, total=False):
    """The arguments ``HFStyleDDPPlusStrategy`` takes by their Hugging Face names."""

    process_group_backend: str | None
    """``"nccl"``, ``"gloo"``, ``"mpi"``, ``"ucc"``, ``"xccl"``, ``"hccl"``, ``"cncl"``, or ``None``/``"auto"`` to follow the accelerator (cuda->nccl, cpu->gloo, xpu->xccl, hpu->hccl, mlu->cncl)."""

    timeout: TimeoutLike | None
    """How long a collective may wait before the job fails: seconds, a ``timedelta``, ``"90s"``, ``"30m"``, ``"2h"``, ``"1h30m"``, ``"1d"``, ``"0:30:00"`` or ``"1 day, 0:00:00"``. Default 30 minutes."""

    find_unused_parameters: bool
    """Let DDP find parameters that get no gradient in an iteration."""

    bucket_cap_mb: float | Literal["auto"] | None
    """Size of the gradient buckets in MiB. ``None`` (default): torch's default, 25 MiB with a 1 MiB first bucket, as stock ``DDPStrategy``. A number: every bucket that size. ``"auto"``: time 25 (the default), 1, 5 and 100 MiB for 3 optimizer steps each, keep the fastest for the rest of the fit and log the choice (``bucket_choice``); not with PowerSGD hooks, whose state is per bucket."""

    broadcast_buffers: bool | Literal["auto"]
    """Keep buffers (e.g. BatchNorm statistics) equal to rank 0's at every forward. ``"auto"``: on when the model has buffers that training changes (BatchNorm-style running statistics), off otherwise."""

    static_graph: bool
    """Promise DDP that the graph and the set of used parameters never change."""

    gradient_accumulation_steps: int | None
    """Micro-batches per optimizer step; the gradient all-reduce runs only on the last one of each window, in automatic and manual optimization. The same as ``Trainer(accumulate_grad_batches=...)``: set either (they must agree if both are set; checked when ``fit`` starts, before any process is launched)."""

    average_items_across_ranks: bool
    """When the training step returns ``num_items`` (the items its loss is a mean over: valid tokens, samples), each optimizer step's gradient is the mean over every item of the accumulation window. ``True`` (default): over every rank's items, as one device computing the global batch would (the counts ride in the last gradient bucket; one small all-reduce per optimizer step where they cannot: a comm hook, sharding, 16-bit gradients). ``False``: over each rank's own items, then averaged over the ranks (the Hugging Face Trainer's ``average_tokens_across_devices=False``). Without ``num_items``, micro-batches weigh the same (and the chunks of ``chunk_size`` weigh their rows)."""


class _TrainerOnly(TypedDict, total=False):
    """The arguments of the Trainer strategy only."""

    model_averaging_period: int | None
    """Period of model averaging for post-local SGD, as in Lightning's ``DDPStrategy`` (Trainer only)."""

    resume_from_last: ResumeMode
    """Resume ``fit`` from the last checkpoint (``ModelCheckpoint(save_last=True)``) when one exists: ``"on_restart"`` (default) in an attempt that torchrun restarted after a failure, ``"always"``, or ``"never"``. A ``ckpt_path`` you set yourself wins. Under torchrun the process group of each attempt is created on a store of its own, and a mid-epoch checkpoint resumes at the batch where it was taken (Trainer only)."""

    on_world_size_change: WorldSizeChange
    """A resume (``ckpt_path``, ``resume_from_last``, a torchrun restart) on a different number of ranks than the checkpoint's: ``"keep_global_batch"`` (default) recomputes accumulation so that each optimizer step trains as many rows as before (refused, naming the sizes that fit, when no accumulation can), ``"keep_per_rank_batch"`` keeps accumulation and says how the global batch changes, ``"error"`` refuses. Either way the epoch resumes at the same sample of its permutation (Lightning's ``DistributedSampler``), and one line says what changed (Trainer only)."""

    save_on_rank_death: bool
    """When a rank dies during a Trainer fit (SIGKILL, a segfault, an out-of-memory kill, its node lost), the ranks that survive save the last optimizer step one of them holds, from one of them, atomically, to the file ``ckpt_path="last"`` and ``resume_from_last`` find, and end with ``RankDied`` naming the dead rank, the step, the file and how to resume: at most the step in progress is lost. On gloo a survivor learns of the death at its next collective (at once; the job ends within a minute of it plus the save); on NCCL the launcher's notice of the death aborts the survivors' communicators, and the save needs ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (torch's default ends the process instead). Nothing is done per step but keeping a few loop counters at each step boundary. With the popen launcher (the default) and torchrun; not with ``start_method="spawn"``, whose survivors torch ends at once; with ``optimizer_sharding`` nothing can be saved (the dead rank's shard is gone) and the error says so. Default on ("What a crash costs" in the guides). With Fabric, ``with fabric.strategy.save_after_rank_death(path, state):`` around the loop does the same."""


class _FurtherDDPArguments(TypedDict, total=False):
    """Further arguments of torch's ``DistributedDataParallel``, checked against its signature."""

    device_ids: Any
    output_device: Any
    dim: Any
    init_sync: Any
    process_group: Any
    check_reduction: Any
    delay_all_reduce_named_params: Any
    param_to_hook_all_reduce: Any
    mixed_precision: Any
    device_mesh: Any
    skip_all_reduce_unused_params: Any
    bucket_cap_mb_list: Any
    batched_grad_copy: Any
    forward_sync_buffers: Any


class DDPPlusFabricStrategyKeywords(_Shared, _Ported, _FurtherDDPArguments, total=False):
    """``DDPPlusFabricStrategy(...)``'s arguments beyond Fabric's plumbing."""


class DDPPlusStrategyKeywords(DDPPlusFabricStrategyKeywords, _TrainerOnly, total=False):
    """``DDPPlusStrategy(...)``'s arguments beyond Lightning's plumbing."""


class HFStyleKeywords(_Shared, _TrainerOnly, total=False):
    """``HFStyleDDPPlusStrategy(...)``'s arguments beyond the Hugging Face names it ports."""


#: Each argument's docstring, whitespace folded.
ARGUMENT_DOCS: dict[str, str] = {
    "process_group_backend": '``"nccl"``, ``"gloo"``, ``"mpi"``, ``"ucc"``, ``"xccl"``, ``"hccl"``, ``"cncl"``, or ``None``/``"auto"`` to follow the accelerator (cuda->nccl, cpu->gloo, xpu->xccl, hpu->hccl, mlu->cncl).',
    "timeout": 'How long a collective may wait before the job fails: seconds, a ``timedelta``, ``"90s"``, ``"30m"``, ``"2h"``, ``"1h30m"``, ``"1d"``, ``"0:30:00"`` or ``"1 day, 0:00:00"``. Default 30 minutes.',
    "setup_timeout": "How long a collective may wait from the process group's creation to the first training step: the ranks waiting while rank 0 prepares data or loads a large model. The first training forward sets the group's timeout to ``timeout`` (and the end of the fit back), so a stuck step is not waited for as long. The same forms as ``timeout``; ``None`` (default): ``timeout`` throughout. Needs a gloo or NCCL process group.",
    "find_unused_parameters": "Let DDP find parameters that get no gradient in an iteration.",
    "bucket_cap_mb": 'Size of the gradient buckets in MiB. ``None`` (default): torch\'s default, 25 MiB with a 1 MiB first bucket, as stock ``DDPStrategy``. A number: every bucket that size. ``"auto"``: time 25 (the default), 1, 5 and 100 MiB for 3 optimizer steps each, keep the fastest for the rest of the fit and log the choice (``bucket_choice``); not with PowerSGD hooks, whose state is per bucket.',
    "broadcast_buffers": 'Keep buffers (e.g. BatchNorm statistics) equal to rank 0\'s at every forward. ``"auto"``: on when the model has buffers that training changes (BatchNorm-style running statistics), off otherwise.',
    "static_graph": "Promise DDP that the graph and the set of used parameters never change.",
    "gradient_as_bucket_view": "Make gradients views into the communication buckets (saves memory).",
    "ddp_comm_hook": '``"fp16"``, ``"bf16"``, ``"powersgd"``, ``"batched_powersgd"``, a dotted import path to a hook function, or a callable ``hook(state, bucket)``. Registered on every backend, gloo included.',
    "ddp_comm_state": "State passed to the hook; PowerSGD gets a default state when this is ``None``.",
    "ddp_comm_wrapper": "Wrapper applied to the hook, e.g. torch's ``fp16_compress_wrapper``.",
    "model_averaging_period": "Period of model averaging for post-local SGD, as in Lightning's ``DDPStrategy`` (Trainer only).",
    "gradient_accumulation_steps": "Micro-batches per optimizer step; the gradient all-reduce runs only on the last one of each window, in automatic and manual optimization. The same as ``Trainer(accumulate_grad_batches=...)``: set either (they must agree if both are set; checked when ``fit`` starts, before any process is launched).",
    "chunk_size": 'Rows per chunk: each training batch is split along its first dimension into chunks of this many rows, each runs forward and backward with its loss weighted by its share of the rows, only the last one all-reduces, and one optimizer step follows the batch: the global batch, the schedule and ``global_step`` stay as they are. It multiplies with accumulation. ``"auto"``: start with the whole batch; when any rank runs out of memory in a forward or backward, every rank drops the batch\'s gradients, halves the size and runs the batch again, and keeps the size that held (logged once, saved in checkpoints). ``None`` (default): the whole batch; an out-of-memory error on one rank then ends every rank with an error that names it. Automatic optimization only.',
    "short_window": 'How the short last window of an epoch is averaged. ``"mean"`` (default): the mean over the micro-batches it really had. ``"lightning"``: Lightning\'s rule, the sum divided by k.',
    "average_items_across_ranks": "When the training step returns ``num_items`` (the items its loss is a mean over: valid tokens, samples), each optimizer step's gradient is the mean over every item of the accumulation window. ``True`` (default): over every rank's items, as one device computing the global batch would (the counts ride in the last gradient bucket; one small all-reduce per optimizer step where they cannot: a comm hook, sharding, 16-bit gradients). ``False``: over each rank's own items, then averaged over the ranks (the Hugging Face Trainer's ``average_tokens_across_devices=False``). Without ``num_items``, micro-batches weigh the same (and the chunks of ``chunk_size`` weigh their rows).",
    "checkpointing_conflict": 'What to do when the DDP settings conflict with the model (gradient checkpointing, reused or unused parameters; see the rule table in the docs\' conflict checks guide). The first training forward is observed and the decision taken at the first backward: ``"error"`` (default) raises ``DDPConflictError`` before any gradient is all-reduced or any optimizer step runs; ``"warn"`` warns once per rule and trains as stock DDP would; ``"resolve"`` changes the settings (and, for rule R5, the model\'s input grads) to a working combination and logs what changed; ``"off"`` checks nothing at the first forward. For what the per-step guard finds later (rule R6), ``"resolve"`` and ``"warn"`` switch ``find_unused_parameters`` on and train on with that step\'s gradients averaged; ``"error"`` and ``"off"`` raise.',
    "verify_replicas_every_n_steps": "Every N optimizer steps, check that all ranks hold identical parameters (and buffers, when ``broadcast_buffers`` is on); a mismatch stops training with ``ReplicaDriftError`` naming the tensor, the ranks and the step. ``None`` (default): off.",
    "telemetry": "Record, per optimizer step, buckets all-reduced, bytes sent, synced and skipped backward passes and torch's timings of forward, backward compute, communication and overlap, logged under ``ddp/`` (with the Trainer, adds the ``DDPTelemetry`` callback).",
    "start_method": 'How processes are started: ``"popen"`` (re-run the script), ``"spawn"``, ``"fork"``, ``"forkserver"``.',
    "resume_from_last": 'Resume ``fit`` from the last checkpoint (``ModelCheckpoint(save_last=True)``) when one exists: ``"on_restart"`` (default) in an attempt that torchrun restarted after a failure, ``"always"``, or ``"never"``. A ``ckpt_path`` you set yourself wins. Under torchrun the process group of each attempt is created on a store of its own, and a mid-epoch checkpoint resumes at the batch where it was taken (Trainer only).',
    "on_world_size_change": 'A resume (``ckpt_path``, ``resume_from_last``, a torchrun restart) on a different number of ranks than the checkpoint\'s: ``"keep_global_batch"`` (default) recomputes accumulation so that each optimizer step trains as many rows as before (refused, naming the sizes that fit, when no accumulation can), ``"keep_per_rank_batch"`` keeps accumulation and says how the global batch changes, ``"error"`` refuses. Either way the epoch resumes at the same sample of its permutation (Lightning\'s ``DistributedSampler``), and one line says what changed (Trainer only).',
    "preemption_signals": "The signals that mean \"save and stop\" (a termination notice): SIGTERM (default: Kubernetes, torchrun's agent, SLURM at the time limit), SIGUSR1/SIGUSR2 for SLURM's ``--signal=SIGUSR1@90``; ``[]``: off (Lightning's own handling, as stock). The handler only records the notice; every rank stops after the same optimizer step (at most one step after the notice, a window of accumulation finished), the Trainer saves it atomically where ``ckpt_path=\"last\"`` finds it, and ``fit`` raises ``Preempted`` (a ``SIGTERMException``; exit code 128 + the signal's number). Its flag rides in the last gradient bucket, so a run without a notice pays nothing (with PowerSGD's or a user's ``ddp_comm_hook``, or ``optimizer_sharding=\"overlap\"``: in ``sync_guard``'s all-reduce). With Fabric, ask ``strategy.preemption_agreed`` after the optimizer step (the preemption guide).",
    "sync_guard": 'After every backward that should synchronize, check on every rank that torch\'s reducer all-reduced every bucket, and act before the optimizer step (rule R6): no optimizer step is ever applied with gradients that were not all-reduced, and a parameter unused on some ranks only ends the step with an error instead of a hang. The ranks agree with a few integers appended to the last gradient bucket, on every backend: no message or store call of its own (with ``optimizer_sharding=True``, appended to the last bucket\'s reduce-scatter; with ``ddp_comm_hook="fp16"`` or ``"bf16"``, to its last compressed bucket). With PowerSGD\'s or a user\'s ``ddp_comm_hook``, a ``ddp_comm_wrapper`` or ``optimizer_sharding="overlap"`` (the buckets are theirs), one all-reduce of a few integers per step on a small gloo group of their own. Default on.',
    "uneven_inputs": 'Ranks whose shards hold different numbers of batches (an ``IterableDataset`` split by rank, ``use_distributed_sampler=False``): ``"error"`` (default) raises ``UnevenInputsError`` on every rank at the first batch that is one rank\'s last and not another\'s, naming the counts; ``"stop"`` ends the epoch on every rank there and reports, once per epoch, the batches left untrained; ``"join"`` lets the longer ranks train on while the others repeat their last batch with weight 0, the gradient being the mean over the batches really trained. Nothing is compared when every training loader has a ``DistributedSampler`` (even by construction). With Fabric it needs ``strategy.micro_batches(loader)``.',
    "atomic_checkpoints": "Write every checkpoint to a temporary file beside its target, fsync it, rename it over the target and fsync the directory, so a kill, a full disk or a node crash during a save leaves the previous file whole. A checkpoint IO you pass stays yours, as passed: Lightning's own ``TorchCheckpointIO`` is saved atomically, another class is left to save as it saves (said once; wrap it in ``AtomicCheckpointIO`` yourself to make its saves atomic). Default on.",
    "save_on_rank_death": 'When a rank dies during a Trainer fit (SIGKILL, a segfault, an out-of-memory kill, its node lost), the ranks that survive save the last optimizer step one of them holds, from one of them, atomically, to the file ``ckpt_path="last"`` and ``resume_from_last`` find, and end with ``RankDied`` naming the dead rank, the step, the file and how to resume: at most the step in progress is lost. On gloo a survivor learns of the death at its next collective (at once; the job ends within a minute of it plus the save); on NCCL the launcher\'s notice of the death aborts the survivors\' communicators, and the save needs ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (torch\'s default ends the process instead). Nothing is done per step but keeping a few loop counters at each step boundary. With the popen launcher (the default) and torchrun; not with ``start_method="spawn"``, whose survivors torch ends at once; with ``optimizer_sharding`` nothing can be saved (the dead rank\'s shard is gone) and the error says so. Default on ("What a crash costs" in the guides). With Fabric, ``with fabric.strategy.save_after_rank_death(path, state):`` around the loop does the same.',
    "optimizer_sharding": 'ZeRO stage 1, each rank keeping the optimizer state of 1/N of the model. ``True``: each gradient bucket is reduce-scattered during the backward, each rank steps its chunk of every bucket (padded to a multiple of the world size), and the updated parameters are all-gathered: the bytes of DDP\'s all-reduce, exact, on every backend (on gloo through pairwise exchanges); refused with ``ddp_comm_hook`` (it is the hook). ``"all_reduce"``: torch\'s ``ZeroRedundancyOptimizer`` after the full all-reduce, whole parameters per rank, the updated parameters broadcast (1.5x DDP\'s bytes); the one to pick with a compressing comm hook. ``"overlap"`` runs that step inside the backward with torch\'s ``hook_with_zero_step`` (NCCL/HCCL only: refused on gloo before launch; torch applies no update in the first 2 steps, 3 with ``static_graph``; refused with a comm hook, accumulation, ``bucket_cap_mb="auto"``, ``sync_guard``, ``uneven_inputs="join"`` and gradient clipping). Checkpoints hold the consolidated, plain optimizer state (gathered on rank 0 at each save). Default ``False``.',
    "stall_report_after": "How long a collective may be waited in before the ranks compare what they are doing, through the job's store, and say why: ranks out of step (a collective issued on some ranks only, e.g. ``self.log(..., sync_dist=True)`` on one rank) end the job at once with each rank's collective and line; a rank that has not reached the collective is named with its line and stack, and the collective timeout's error carries the same report. ``\"auto\"`` (default): a quarter of ``timeout``, at most 5 minutes. ``None``: off. The same forms as ``timeout``, and shorter than it.",
    "ledger_length": "The collectives each rank remembers (its collective ledger), for the stall report. ``0``: none (the ledger is off), which needs ``stall_report_after=None``.",
    "find_stragglers_every_n_steps": "Every N optimizer steps, the ranks compare their median time per step in data fetch, compute (less the time waited in collectives), collective wait and optimizer step (one gather of five integers per rank: the medians and the steps they cover), and a rank the others wait for gets one warning (repeated at most every 5 minutes) naming it, the phase and the figures. ``None``: off.",
}
