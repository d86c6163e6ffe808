"""How the device a job trains on spends memory where that differs from the CPU the plan usually measures on.

``ddp-plus check`` runs where the config is (often a login node with no GPU) and measures one real step there, on
the CPU. Two things the same step does differently on an accelerator change its peak, and both are reproduced on
the CPU instead of guessed:

- **The optimizer's implementation.** With ``foreach`` left unset, torch's optimizers pick the ``foreach``
  implementation when every parameter is on a device with foreach kernels (CUDA, XPU ...), and the per-parameter
  loop on the CPU. The foreach step holds intermediates the size of a whole parameter group (Adam's
  ``exp_avg_sq.sqrt()`` of every parameter at once) where the loop holds those of one parameter. The plan runs the
  target's implementation on the CPU: foreach kernels have a CPU implementation that allocates the same tensors.
- **The allocator's rounding.** The CUDA caching allocator hands out blocks in multiples of 512 bytes, and
  ``torch.cuda.max_memory_allocated`` counts the blocks; the plan counts each storage the same way.

What no CPU run can show (the CUDA context, the cuBLAS workspace, NCCL's buffers, blocks cached but free) stays in
the plan's headroom.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_ddp_plus.private_apis.torch_distributed import foreach_devices


@dataclass(frozen=True, kw_only=True)
class DeviceAllocation:
    """How one device type allocates what a training step holds."""

    device_type: str
    """torch's name for the device type (``"cpu"``, ``"cuda"``, ...)."""
    granularity: int
    """Each allocation is rounded up to a multiple of this many bytes, as the device's allocator counts it."""
    foreach_optimizers: bool
    """Whether torch's optimizers default to their ``foreach`` implementation for parameters on this device."""
    granularity_known: bool = True
    """``False`` where this project has no figure for the allocator's rounding (the plan then counts exact bytes and
    says so)."""


#: The allocators whose rounding is known: the CUDA caching allocator's smallest block and multiple is 512 bytes;
#: the CPU's glibc allocator is counted by the bytes asked for (what a tensor holds).
GRANULARITY: dict[str, int] = {"cpu": 1, "cuda": 512}


def foreach_device_types() -> frozenset[str]:
    """The device types torch runs its optimizers' ``foreach`` implementation on by default, read from torch itself
    (the list grows between versions); CUDA alone where this torch does not publish it."""
    return foreach_devices()


def device_allocation(device_type: str) -> DeviceAllocation:
    """What the plan reproduces for a step on ``device_type``.

    >>> device_allocation("cuda")
    DeviceAllocation(device_type='cuda', granularity=512, foreach_optimizers=True, granularity_known=True)
    >>> device_allocation("cpu").foreach_optimizers
    False
    """
    known = device_type in GRANULARITY
    return DeviceAllocation(
        device_type=device_type,
        granularity=GRANULARITY.get(device_type, 1),
        foreach_optimizers=device_type in foreach_device_types(),
        granularity_known=known,
    )


def rounded(size: int, granularity: int) -> int:
    """``size`` bytes as an allocator of that granularity hands them out (an empty storage takes nothing).

    >>> rounded(1, 512), rounded(512, 512), rounded(513, 512), rounded(0, 512), rounded(7, 1)
    (512, 512, 1024, 0, 7)
    """
    return -(-size // granularity) * granularity


def is_known_device_type(device_type: str) -> bool:
    """Whether torch knows ``device_type`` (what ``--device-type`` accepts)."""
    try:
        torch.device(device_type)
    except RuntimeError:
        return False
    return ":" not in device_type
