"""Process-group backend names: validation, the automatic choice per device, and the fit between the two.

Everything here is a plain function over strings so that CUDA, XPU or HPU set-ups can be checked on a CPU machine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed

from lightning_ddp_plus.config.messages import ArgumentTypeError, ArgumentValueError, closest_name, describe_bad_value

#: Backends a user may name. ``None`` or ``"auto"`` picks one from the accelerator.
KNOWN_BACKENDS = ("nccl", "gloo", "mpi", "ucc", "xccl", "hccl", "cncl")

#: The backend chosen when ``process_group_backend`` is ``None``/``"auto"``, by device type.
AUTO_BACKEND_BY_DEVICE = {
    "cuda": "nccl",
    "cpu": "gloo",
    "xpu": "xccl",
    "hpu": "hccl",
    "npu": "hccl",
    "mlu": "cncl",
    "mps": "gloo",
}

#: The device types each backend can move tensors of. A device type missing from every entry is not judged.
DEVICES_BY_BACKEND = {
    "nccl": ("cuda",),
    "gloo": ("cpu", "cuda", "mps"),
    "mpi": ("cpu", "cuda"),
    "ucc": ("cpu", "cuda"),
    "xccl": ("xpu",),
    "hccl": ("hpu", "npu"),
    "cncl": ("mlu",),
}

_AUTO = ("auto", "")


def normalize_backend(value: str | None) -> str | None:
    """Validate a backend name given by the user; ``None`` means "choose from the accelerator".

    >>> normalize_backend("NCCL")
    'nccl'
    >>> normalize_backend("auto") is None
    True
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise ArgumentTypeError(
            describe_bad_value(
                "process_group_backend",
                value,
                f"expected a backend name, one of {', '.join(KNOWN_BACKENDS)}, or 'auto'.",
                "pass the name as a string, e.g. 'gloo'.",
            )
        )
    name = value.strip().lower()
    if name in _AUTO:
        return None
    if name in KNOWN_BACKENDS:
        return name
    suggestion = closest_name(name, KNOWN_BACKENDS + ("auto",))
    hint = (
        f"did you mean {suggestion!r}?"
        if suggestion
        else "use one of the names listed, or 'auto' to choose from the accelerator."
    )
    raise ArgumentValueError(
        describe_bad_value(
            "process_group_backend",
            value,
            f"unknown backend; allowed: {', '.join(KNOWN_BACKENDS)}, or 'auto'/None (from the accelerator).",
            hint,
        )
    )


def auto_backend_for_device(device_type: str) -> str:
    """The backend ``"auto"`` resolves to on a device type (cuda->nccl, cpu->gloo, xpu->xccl, hpu->hccl, mlu->cncl)."""
    if device_type in AUTO_BACKEND_BY_DEVICE:
        return AUTO_BACKEND_BY_DEVICE[device_type]
    torch_default = torch.distributed.Backend.default_device_backend_map.get(device_type)
    if torch_default is not None:
        return torch_default
    raise ArgumentValueError(
        describe_bad_value(
            "process_group_backend",
            "auto",
            f"there is no default backend for device type {device_type!r}; known device types: {', '.join(sorted(AUTO_BACKEND_BY_DEVICE))}.",
            f"name the backend your {device_type!r} devices use, e.g. `process_group_backend='gloo'`.",
        )
    )


def has_default_backend(device_type: str) -> bool:
    """Whether ``"auto"`` has a backend for this device type (``"xla"`` has none: XLA strategies make their own).

    >>> has_default_backend("cuda"), has_default_backend("xla")
    (True, False)
    """
    return device_type in AUTO_BACKEND_BY_DEVICE or device_type in torch.distributed.Backend.default_device_backend_map


def _installed_alternative(backend: str, device_type: str, is_available: Callable[[str], bool]) -> str:
    """Another backend for ``device_type`` that this torch provides, the device's own first."""
    fitting = [name for name, types in DEVICES_BY_BACKEND.items() if device_type in types and name != backend]
    fitting.sort(key=lambda name: name != AUTO_BACKEND_BY_DEVICE.get(device_type))
    installed = next((name for name in fitting if is_available(name)), None)
    return repr(installed) if installed is not None else f"a backend this torch provides for {device_type!r}"


def resolve_backend_for_device(
    requested: str | None,
    device_type: str,
    is_available: Callable[[str], bool] = torch.distributed.is_backend_available,
    check_available: bool = True,
) -> str:
    """Resolve ``requested`` (already normalized) against the device type the accelerator trains on.

    Raises if the backend cannot move tensors of that device type or (``check_available``) is not available in the
    installed torch.

    >>> resolve_backend_for_device(None, "cpu")
    'gloo'
    >>> resolve_backend_for_device("nccl", "cpu")
    Traceback (most recent call last):
    ...
    lightning_ddp_plus.config.messages.ArgumentValueError: `process_group_backend='nccl'` is not valid: ...
    """
    backend = requested if requested is not None else auto_backend_for_device(device_type)
    supported = DEVICES_BY_BACKEND.get(backend, ())
    judged = any(device_type in types for types in DEVICES_BY_BACKEND.values())
    if judged and device_type not in supported:
        fitting = [name for name, types in DEVICES_BY_BACKEND.items() if device_type in types]
        raise ArgumentValueError(
            describe_bad_value(
                "process_group_backend",
                backend,
                f"{backend!r} cannot run collectives on {device_type!r} devices (it needs {' or '.join(supported)}); "
                f"backends for {device_type!r}: {', '.join(fitting)}.",
                f"set `process_group_backend` to {AUTO_BACKEND_BY_DEVICE.get(device_type, fitting[0])!r} or 'auto', "
                f"or choose an accelerator that {backend!r} supports.",
            )
        )
    if check_available and not is_available(backend):
        raise ArgumentValueError(
            describe_bad_value(
                "process_group_backend",
                backend,
                f"the installed torch {torch.__version__} has no {backend!r} backend "
                "(torch.distributed.is_backend_available() is False).",
                f"install a torch build (or the vendor plugin) that provides {backend!r}, or use "
                f"{_installed_alternative(backend, device_type, is_available)}.",
            )
        )
    return backend
