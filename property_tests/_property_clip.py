"""The oracle of the clipping properties: ``torch.nn.utils.clip_grad_norm_``'s two halves.

Written without freplicate. The tensor leaves, in ``torch.utils._pytree``'s
order (dicts in insertion order, as ``named_parameters()``), go through
``get_total_norm`` as they are (so that torch sums in the leaf's own memory
order: an expanded leaf is no ``.grad`` that ``clip_grad_norm_`` could
scale in place), then ``clip_grads_with_norm_`` scales copies of them as
the ``.grad`` of parameters of their own. ``clip_grad_norm_`` is exactly
these two calls.

``pieced_slack`` says how far from torch's a total put together from row
pieces (``fr.distributed.clip_grad_norm``) may lie, and why: torch
rounds every tensor's norm once to the tensor's dtype, so a half-precision
tensor's norm must come out equal to torch's (the defect it guards against
rounded every piece first, 1e-3 away), except where its exact value lies
so near a rounding boundary of its dtype that torch's own float32 sum may
have crossed it; a float32 or float64 tensor's norm is summed in another
order, and may differ in its last bits.
"""

from __future__ import annotations

import math
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


_HALF = {
    torch.float16: torch.float16,
    torch.bfloat16: torch.bfloat16,
    torch.complex32: torch.float16,
}
# torch sums a half-precision tensor's norm in float32: on the tests' sizes (thousands of
# elements at most) it lies far closer than this to the exact value
_MARGIN = 1e-5
# a float32 or float64 norm summed in another order: units in its last place, p-th root included
_ORDER_ULPS = 16


def pieced_slack(tensors: list[torch.Tensor], norm_type: Any, want_total: torch.Tensor) -> float:
    """How far a total norm put together from row pieces may lie from ``want_total``, torch's.

    Zero (the total must be torch's, bit for bit) for ``p`` in ``{inf, -inf,
    0}`` (a max, a min, a count: nothing rounds), for a non-finite or zero
    total, and where every tensor is half-precision and none of their exact
    norms lies within ``_MARGIN`` (relative) of a rounding boundary of its
    dtype. Otherwise twice (for what a first-order bound leaves out) the sum
    over the tensors of ``d total / d norm_i`` times what ``norm_i`` may be
    off by: one step of its dtype for a half-precision tensor near a
    boundary, ``_ORDER_ULPS`` units in the last place of a float32 or float64
    one; and one unit in the last place of the total's dtype for the last
    rounding.
    """
    p = float(norm_type)
    total = float(want_total)
    if p in (math.inf, -math.inf, 0.0) or not math.isfinite(total) or total == 0:
        return 0.0
    slack = 0.0
    for t in tensors:
        wide = torch.complex128 if t.is_complex() else torch.float64
        exact = float(torch.linalg.vector_norm(t.detach().to(wide), p))
        if exact == 0 or not math.isfinite(exact):
            continue
        if t.dtype in _HALF:
            bounds = torch.tensor(
                [exact * (1 - _MARGIN), exact * (1 + _MARGIN)], dtype=torch.float64
            )
            lo, hi = bounds.to(_HALF[t.dtype]).double().tolist()
            off = hi - lo  # 0 unless a boundary lies within the margin: then one step
        else:
            real = t.real.dtype if t.is_complex() else t.dtype
            off = _ORDER_ULPS * torch.finfo(real).eps * exact / min(abs(p), 1.0)
        if off:
            slack += (exact / total) ** (p - 1) * off
    if slack:
        slack = 2 * slack + torch.finfo(want_total.dtype).eps * abs(total)
    return slack


def assert_pieced_total(
    total: torch.Tensor, want_total: torch.Tensor, tensors: list[torch.Tensor], norm_type: Any
) -> float:
    """``total`` is ``want_total`` within ``pieced_slack`` (of torch's dtype); the slack, relative."""
    assert total.dtype == want_total.dtype, f"total in {total.dtype}, torch's in {want_total.dtype}"
    slack = pieced_slack(tensors, norm_type, want_total)
    if slack == 0:
        same = torch.equal(total, want_total) or bool(total.isnan() and want_total.isnan())
        assert same, (
            f"norm_type={norm_type}: total {total.item()!r}, torch's {want_total.item()!r} (bit for bit)"
        )
        return 0.0
    gap = abs(total.double().item() - want_total.double().item())
    assert gap <= slack, (
        f"norm_type={norm_type}: total {total.item()!r}, torch's {want_total.item()!r}: "
        f"{gap:.3g} apart, {slack:.3g} allowed"
    )
    return slack / abs(want_total.double().item())


def gradients(
    dtypes: tuple[torch.dtype, ...], shapes: list[tuple[int, ...]], seed: int
) -> dict[str, torch.Tensor]:
    """Gradients of ``shapes``, of ``dtypes`` in turn: magnitudes 1e-2 to 1e2, a tenth zeros.

    Drawn in float64 (complex128) and rounded once to the leaf's dtype, so
    that the same seed gives the same gradients on every rank.
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, shape in enumerate(shapes):
        dtype = dtypes[i % len(dtypes)]
        wide = torch.complex128 if dtype.is_complex else torch.float64
        x = torch.randn(shape, generator=g, dtype=wide) * 10.0 ** (i % 5 - 2)
        x = x.masked_fill(torch.rand(shape, generator=g) < 0.1, 0)
        out[f"{i}.{str(dtype).removeprefix('torch.')}"] = x.to(dtype)
    return out


def assert_clipped(got: Any, want: Any, relative: float) -> None:
    """Clipped gradients (trees): bit for bit where the totals are (``relative`` 0, from
    ``assert_pieced_total``), else within twice the totals' gap and a rounding of the leaf's dtype."""
    if relative == 0:
        assert_bitwise(got, want)
        return
    for k, a, w in _tensor_pairs(got, want):
        rtol = 2 * relative + torch.finfo(w.real.dtype if w.is_complex() else w.dtype).eps
        torch.testing.assert_close(a, w, rtol=rtol, atol=0, msg=lambda m, k=k: f"leaf {k}: {m}")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s values in logical order: equal bits, equal bytes (NaNs and -0.0 too)."""
    flat = t.detach().reshape(-1)
    return (
        torch.empty_like(flat, memory_format=torch.contiguous_format).copy_(flat).view(torch.uint8)
    )


def _tensor_pairs(actual: Any, expected: Any) -> list[tuple[int, Any, torch.Tensor]]:
    """``(leaf index, actual's leaf, expected's tensor)``, once the structures and every
    non-tensor leaf (the very object) are checked equal."""
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    assert a_spec == e_spec, f"structures differ: {a_spec} != {e_spec}"
    pairs = []
    for k, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        if isinstance(e, torch.Tensor):
            pairs.append((k, a, e))
        else:
            assert a is e, f"leaf {k}: {a!r} is not the given {e!r}"
    return pairs


def assert_bitwise(actual: Any, expected: Any) -> None:
    """Same structure and, leaf for leaf, tensors of one dtype and device with the same bits."""
    for k, a, e in _tensor_pairs(actual, expected):
        assert isinstance(a, torch.Tensor), f"leaf {k}: {a!r} where torch has a tensor"
        assert (a.dtype, a.device, a.shape) == (e.dtype, e.device, e.shape), (
            f"leaf {k}: {a.dtype} {a.device} {tuple(a.shape)} != {e.dtype} {e.device} {tuple(e.shape)}"
        )
        assert torch.equal(bits(a), bits(e)), f"leaf {k}: {a} != {e} (bits differ)"
