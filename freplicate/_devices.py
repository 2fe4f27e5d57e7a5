"""Device specs: parse ``int`` / ``str`` / ``torch.device`` into ``torch.device``.

The single place where a device spec is validated, so that every public
function rejects a bad device with the same words: ``ValueError`` naming the
function, the argument and the device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ._typing import DeviceSpec

__all__ = ["DeviceSpec", "as_device", "as_devices"]

# The host specs every call names, answered without parsing (parsing costs more
# than a same-device replicate itself). A fixed table, not a cache: nothing grows.
_HOST: dict[str | torch.device, torch.device] = {
    spec: torch.device(kind)
    for kind in ("cpu", "meta")
    for spec in (kind, f"{kind}:0", torch.device(kind), torch.device(kind, 0))
}


def as_device(spec: DeviceSpec, *, caller: str, arg: str = "device") -> torch.device:
    """Parse and validate one device spec.

    >>> as_device("cpu", caller="f")
    device(type='cpu')
    >>> as_device("tpu:3", caller="fr.replicate", arg="devices[1]")
    Traceback (most recent call last):
    ...
    ValueError: fr.replicate: devices[1] is not a device: 'tpu:3' ...
    """
    if isinstance(spec, torch.device):
        device = spec
    elif isinstance(spec, bool):  # bool is an int; True is no CUDA index
        raise ValueError(f"{caller}: {arg} is not a device: {spec!r}")
    elif isinstance(spec, int):
        if spec < 0:
            raise ValueError(f"{caller}: {arg} is not a device: CUDA index {spec} is negative")
        device = torch.device("cuda", spec)
    elif isinstance(spec, str):
        try:
            device = torch.device(spec)
        except RuntimeError as err:
            raise ValueError(
                f"{caller}: {arg} is not a device: {spec!r} "
                "(expected e.g. 'cpu', 'cuda:1', 'meta', an int CUDA index or a torch.device)"
            ) from err
    else:
        raise ValueError(
            f"{caller}: {arg} is not a device: {spec!r} of type {type(spec).__name__} "
            "(expected an int CUDA index, a str or a torch.device)"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{caller}: {arg} is {str(device)!r} but CUDA is not available on this machine"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise ValueError(
                f"{caller}: {arg} is {str(device)!r} but this machine has "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
    elif device.type in ("cpu", "meta"):
        # tensors report plain 'cpu' / 'meta': 'cpu:0' must compare equal to their
        # device, or a same-device leaf would be copied instead of shared
        if device.index is not None:
            device = torch.device(device.type)
    else:
        module = getattr(torch, device.type, None)
        is_available = getattr(module, "is_available", None)
        if is_available is None or not is_available():
            raise ValueError(f"{caller}: {arg} is {str(device)!r}, which is not available here")
    return device


def as_devices(
    specs: Iterable[DeviceSpec], *, caller: str, arg: str = "devices"
) -> list[torch.device]:
    """Parse a non-empty list of device specs (repeats allowed).

    >>> as_devices(["cpu", torch.device("cpu")], caller="f")
    [device(type='cpu'), device(type='cpu')]
    >>> as_devices([], caller="fr.replicate")
    Traceback (most recent call last):
    ...
    ValueError: fr.replicate: devices is empty; give at least one device
    """
    if isinstance(specs, (str, int, torch.device)):
        raise ValueError(
            f"{caller}: {arg} must be a list of devices, got a single device {specs!r}; "
            f"wrap it in a list: [{specs!r}]"
        )
    try:
        specs = list(specs)
    except TypeError:
        raise TypeError(
            f"{caller}: {arg} must be a list of devices, got {specs!r} of type "
            f"{type(specs).__name__}; e.g. ['cpu', 'cpu'] or [0, 1]"
        ) from None
    if not specs:
        raise ValueError(f"{caller}: {arg} is empty; give at least one device")
    out = []
    for i, s in enumerate(specs):
        host = _HOST.get(s) if isinstance(s, (str, torch.device)) else None
        out.append(host if host is not None else as_device(s, caller=caller, arg=f"{arg}[{i}]"))
    return out
