"""The rank side of the sharded clipping property (``test_clip.py``), on ``_property_ddp``'s ranks.

``fr.distributed.clip_grad_norm`` of this rank's rows of gradients of a
drawn dtype mix, against ``clip_grad_norm_`` on the full gradients. The
check's name is a ``Check``, whose unpickling in a rank imports this module
and so registers the check there (the ranks were spawned knowing only
``_property_ddp``'s own checks).
"""

from __future__ import annotations

from typing import Any

import optree
import torch
import torch.distributed as dist
from _property_clip import assert_clipped, assert_pieced_total, gradients, torch_clip
from _property_ddp import CHECKS, WORLD
from _property_shard import rows_of
from _property_support import Unchanged

import freplicate as fr


class Check(str):
    """A check's name; unpickling it imports this module (see the module's text)."""

    __slots__ = ()


def assert_sharded_clip(rank: int, full: Any, max_norm: float, norm_type: Any) -> None:
    """``fr.distributed.clip_grad_norm`` of this rank's rows of ``full``: the same total on every
    rank, torch's on ``full`` within ``pieced_slack``, the rows clipped alike; nothing modified."""
    shards = fr.distributed.shard(full)
    unchanged = Unchanged(shards)
    got, total = fr.distributed.clip_grad_norm(shards, max_norm, norm_type=norm_type)
    unchanged.check("fr.distributed.clip_grad_norm")
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, total)
    assert all(torch.equal(t, total) for t in everyone), f"the ranks' totals differ: {everyone}"
    try:
        want, want_total = torch_clip(full, max_norm, norm_type)
    except RuntimeError:  # torch has no max, min or negative power of an empty gradient
        return
    tensors = [t for t in optree.tree_leaves(full) if isinstance(t, torch.Tensor)]
    relative = assert_pieced_total(total, want_total, tensors, norm_type)
    assert_clipped(got, rows_of(want, rank), relative)


def check_sharded_clip(rank: int, p: dict[str, Any]) -> None:
    """``assert_sharded_clip`` on gradients of a drawn dtype mix (``gradients``)."""
    full = gradients(p["dtypes"], p["shapes"], p["seed"])
    assert_sharded_clip(rank, full, p["max_norm"], p["norm_type"])


CHECKS[Check("sharded_clip_of_dtype_mixes")] = check_sharded_clip
