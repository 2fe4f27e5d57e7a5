"""The process group a call runs on: its size, the device its collectives use, transforms."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._torch import transform_level


def _world(group: Any) -> int:
    """Size of ``group``; 1 when torch.distributed is unavailable or not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _comm_device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _not_transformed(fn: str) -> None:
    if transform_level() is not None:
        raise RuntimeError(
            f"{fn}: cannot run under a torch.func transform (vmap, grad, jvp ...): "
            "torch.distributed collectives have no batching or differentiation rule; call "
            "fr.grad_and_value inside the transform and fr.distributed.all_reduce outside it"
        )
