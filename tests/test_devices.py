"""Device specs: every accepted form, normalisation, and every rejection's words."""

from __future__ import annotations

import pytest
import torch

from freplicate._devices import as_device, as_devices

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("cpu", torch.device("cpu")),
        (torch.device("cpu"), torch.device("cpu")),
        ("meta", torch.device("meta")),
        # tensors report plain "cpu": an index must not make the same device look different
        ("cpu:0", torch.device("cpu")),
        (torch.device("cpu", 0), torch.device("cpu")),
    ],
)
def test_as_device_accepts(spec: object, expected: torch.device) -> None:
    device = as_device(spec, caller="f")  # type: ignore[arg-type]
    assert device == expected
    assert device == torch.ones(1, device=device).device


def test_cpu_index_compares_equal_to_tensor_device() -> None:
    # regression: "cpu:0" != torch.device("cpu"), so fr.replicate copied same-device leaves
    t = torch.ones(2)
    assert as_device("cpu:0", caller="f") == t.device


@pytest.mark.parametrize(
    "spec, match",
    [
        ("tpu:3", r"^fr\.replicate: devices\[1\] is not a device: 'tpu:3' \(expected e\.g\. 'cpu'"),
        ("", r"^fr\.replicate: devices\[1\] is not a device: ''"),
        (-1, r"^fr\.replicate: devices\[1\] is not a device: CUDA index -1 is negative$"),
        (True, r"^fr\.replicate: devices\[1\] is not a device: True$"),
        (1.5, r"^fr\.replicate: devices\[1\] is not a device: 1\.5 of type float \(expected"),
        (None, r"^fr\.replicate: devices\[1\] is not a device: None of type NoneType"),
        ("mps", r"^fr\.replicate: devices\[1\] is 'mps', which is not available here$"),
    ],
)
def test_as_device_rejects(spec: object, match: str) -> None:
    if spec == "mps" and torch.backends.mps.is_available():
        pytest.skip("mps is available here")
    with pytest.raises(ValueError, match=match):
        as_device(spec, caller="fr.replicate", arg="devices[1]")  # type: ignore[arg-type]


@no_cuda
@pytest.mark.parametrize("spec", ["cuda", "cuda:1", 0, torch.device("cuda", 0)])
def test_cuda_without_cuda(spec: object) -> None:
    name = "cuda:0" if isinstance(spec, int) or spec == torch.device("cuda", 0) else spec
    with pytest.raises(
        ValueError,
        match=rf"^f: devices\[0\] is '{name}' but CUDA is not available on this machine$",
    ):
        as_devices([spec], caller="f")  # type: ignore[list-item]


@needs_cuda
def test_cuda_specs() -> None:
    n = torch.cuda.device_count()
    assert as_device(0, caller="f") == torch.device("cuda", 0)
    assert as_device("cuda", caller="f") == torch.device("cuda", torch.cuda.current_device())
    with pytest.raises(
        ValueError, match=rf"^f: device is 'cuda:{n}' but this machine has {n} CUDA"
    ):
        as_device(n, caller="f")


def test_repeated_parsing_gives_the_same_answers() -> None:
    # the common host specs come from a fixed table; everything else is parsed every time
    for _ in range(2):
        assert as_devices(["cpu:0", "meta", torch.device("cpu", 0)], caller="f") == [
            torch.device("cpu"),
            torch.device("meta"),
            torch.device("cpu"),
        ]
        with pytest.raises(ValueError, match=r"^f: devices\[1\] is not a device: 'cpux'"):
            as_devices(["cpu", "cpux"], caller="f")


def test_as_devices_keeps_order_and_repeats() -> None:
    devs = as_devices(["cpu", torch.device("cpu"), "meta", "cpu:0"], caller="f")
    assert devs == [torch.device("cpu")] * 2 + [torch.device("meta"), torch.device("cpu")]
    assert as_devices(iter(["meta"]), caller="f") == [torch.device("meta")]  # type: ignore[arg-type]


def test_as_devices_empty() -> None:
    with pytest.raises(ValueError, match=r"^fr\.replicate: devices is empty; give at least one"):
        as_devices([], caller="fr.replicate")


@pytest.mark.parametrize("single", ["cpu", 0, torch.device("cpu")])
def test_as_devices_single_device_not_a_list(single: object) -> None:
    with pytest.raises(
        ValueError, match=r"^g: devs must be a list of devices, got a single device"
    ):
        as_devices(single, caller="g", arg="devs")  # type: ignore[arg-type]


def test_as_devices_names_the_bad_position() -> None:
    with pytest.raises(ValueError, match=r"^g: devices\[2\] is not a device: 'nope'"):
        as_devices(["cpu", "meta", "nope"], caller="g")


def test_parsing_many_specs_keeps_nothing() -> None:
    from freplicate import _devices

    before = dict(_devices._HOST)
    as_devices([f"cpu:{i}" for i in range(100)], caller="f")
    assert _devices._HOST == before


@pytest.mark.parametrize("specs", [None, 3.5])
def test_as_devices_not_a_list(specs: object) -> None:
    with pytest.raises(TypeError, match=r"^fr\.replicate: devices must be a list of devices, got "):
        as_devices(specs, caller="fr.replicate")  # type: ignore[arg-type]
