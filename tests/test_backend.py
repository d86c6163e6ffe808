import pytest
import torch

from lightning_ddp_plus.config.backend import KNOWN_BACKENDS, normalize_backend, resolve_backend_for_device


def always(_: str) -> bool:
    return True


def never(_: str) -> bool:
    return False


@pytest.mark.parametrize("name", KNOWN_BACKENDS)
def test_every_documented_backend_is_accepted(name):
    assert normalize_backend(name) == name
    assert normalize_backend(name.upper()) == name


@pytest.mark.parametrize("value", [None, "auto", "AUTO"])
def test_auto(value):
    assert normalize_backend(value) is None


@pytest.mark.parametrize(("typo", "suggestion"), [("ncll", "nccl"), ("glo", "gloo"), ("xcl", "xccl"), ("hcll", "hccl")])
def test_unknown_backend_suggests_closest(typo, suggestion):
    with pytest.raises(
        ValueError, match=rf"process_group_backend='{typo}'.*unknown backend.*did you mean '{suggestion}'"
    ):
        normalize_backend(typo)


def test_non_string_backend():
    with pytest.raises(TypeError, match="process_group_backend"):
        normalize_backend(3)


@pytest.mark.parametrize(
    ("device", "expected"), [("cuda", "nccl"), ("cpu", "gloo"), ("xpu", "xccl"), ("hpu", "hccl"), ("mlu", "cncl")]
)
def test_auto_follows_the_accelerator(device, expected):
    assert resolve_backend_for_device(None, device, is_available=always) == expected


@pytest.mark.parametrize(
    ("backend", "device"),
    [("nccl", "cpu"), ("xccl", "cpu"), ("xccl", "cuda"), ("hccl", "cuda"), ("cncl", "cpu"), ("nccl", "xpu")],
)
def test_backend_that_does_not_fit_the_device(backend, device):
    with pytest.raises(
        ValueError, match=rf"'{backend}' cannot run collectives on '{device}' devices.*Fix: set `process_group_backend`"
    ):
        resolve_backend_for_device(backend, device, is_available=always)


@pytest.mark.parametrize(("backend", "device"), [("gloo", "cuda"), ("mpi", "cpu"), ("ucc", "cuda"), ("gloo", "cpu")])
def test_backends_that_fit(backend, device):
    assert resolve_backend_for_device(backend, device, is_available=always) == backend


def test_backend_missing_from_installed_torch():
    with pytest.raises(ValueError, match=r"installed torch .* has no 'mpi' backend.*Fix: install"):
        resolve_backend_for_device("mpi", "cpu", is_available=never)


@pytest.mark.parametrize(
    ("backend", "device", "installed", "fix"),
    [
        ("nccl", "cuda", {"gloo"}, "or use 'gloo'"),  # a CPU build of torch on a machine whose devices are faked
        ("gloo", "cpu", {"mpi", "ucc"}, "or use 'mpi'"),
        ("nccl", "cuda", set(), "or use a backend this torch provides for 'cuda'"),
    ],
)
def test_a_missing_backends_fix_names_an_installed_one(backend, device, installed, fix):
    with pytest.raises(ValueError, match="Fix: install") as raised:
        resolve_backend_for_device(backend, device, is_available=installed.__contains__)
    assert str(raised.value).endswith(f"{fix}.")


@pytest.mark.parametrize(("backend", "device"), [("gloo", "cpu"), ("nccl", "cuda"), ("mpi", "cpu"), ("ucc", "cpu")])
def test_real_availability_follows_the_installed_torch(backend, device):
    # The real check (not a stand-in), on whatever build is installed: a CPU build has gloo only, a CUDA build NCCL too.
    if torch.distributed.is_backend_available(backend):
        assert resolve_backend_for_device(backend, device) == backend
    else:
        with pytest.raises(ValueError, match=f"has no '{backend}' backend"):
            resolve_backend_for_device(backend, device)


def test_unknown_device_type_with_auto_asks_for_a_name():
    with pytest.raises(ValueError, match="no default backend for device type 'weird'"):
        resolve_backend_for_device(None, "weird", is_available=always)
