"""The oracle of the clipping properties: ``torch.nn.utils.clip_grad_norm_``'s two halves.

Written without freplicate. The tensor leaves, in ``torch.utils._pytree``'s
order (dicts in insertion order, as ``named_parameters()``), go through
``get_total_norm`` as they are (so that torch sums in the leaf's own memory
order: an expanded leaf is no ``.grad`` that ``clip_grad_norm_`` could
scale in place), then ``clip_grads_with_norm_`` scales copies of them as
the ``.grad`` of parameters of their own. ``clip_grad_norm_`` is exactly
these two calls.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree


def torch_clip(tree: Any, max_norm: float, norm_type: float) -> tuple[Any, torch.Tensor]:
    """``tree`` with every tensor leaf replaced by what ``clip_grad_norm_`` leaves in its ``.grad``."""
    leaves, spec = pytree.tree_flatten(tree)
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    total = torch.nn.utils.get_total_norm([leaves[i] for i in at], norm_type)
    params: dict[int, torch.nn.Parameter] = {}
    for i in at:
        p = torch.nn.Parameter(torch.zeros_like(leaves[i], memory_format=torch.contiguous_format))
        p.grad = leaves[i].detach().clone(memory_format=torch.preserve_format)
        params[i] = p
    torch.nn.utils.clip_grads_with_norm_(list(params.values()), max_norm, total)
    out = [params[i].grad if i in params else leaf for i, leaf in enumerate(leaves)]
    return pytree.tree_unflatten(out, spec), total


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s values in logical order: equal bits, equal bytes (NaNs and -0.0 too)."""
    flat = t.detach().reshape(-1)
    return (
        torch.empty_like(flat, memory_format=torch.contiguous_format).copy_(flat).view(torch.uint8)
    )


def assert_bitwise(actual: Any, expected: Any) -> None:
    """Same structure and, leaf for leaf, tensors of one dtype and device with the same bits."""
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    assert a_spec == e_spec, f"structures differ: {a_spec} != {e_spec}"
    for k, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        if not isinstance(e, torch.Tensor):
            assert a is e, f"leaf {k}: {a!r} is not the given {e!r}"
            continue
        assert isinstance(a, torch.Tensor), f"leaf {k}: {a!r} where torch has a tensor"
        assert (a.dtype, a.device, a.shape) == (e.dtype, e.device, e.shape), (
            f"leaf {k}: {a.dtype} {a.device} {tuple(a.shape)} != {e.dtype} {e.device} {tuple(e.shape)}"
        )
        assert torch.equal(bits(a), bits(e)), f"leaf {k}: {a} != {e} (bits differ)"
