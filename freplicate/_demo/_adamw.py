"""AdamW as plain functions over parameter trees, step for step ``torch.optim.AdamW``.

``init`` and ``update`` hold no state of their own: the moments and the step
count come in and go out as a tree. The arithmetic is that of
``torch.optim.AdamW``'s single-tensor path (its default on CPU), the same
operations in the same order with the same Python-float scalars, written
out of place, so that from the same parameters and gradients both give
bit-identical results (a test checks it) and any difference the demo sees
comes from the gradients, not from the optimiser.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, cast

import optree
import torch

Tree = dict[str, torch.Tensor]


def _map(fn: Callable[..., torch.Tensor], tree: Tree, *rest: Tree) -> Tree:
    """``optree.tree_map``, typed for the parameter dicts the demo uses."""
    return cast(Tree, optree.tree_map(fn, tree, *rest))  # type: ignore[arg-type]


class AdamWState(NamedTuple):
    step: int
    exp_avg: Tree
    exp_avg_sq: Tree


def init(params: Tree) -> AdamWState:
    return AdamWState(0, _map(torch.zeros_like, params), _map(torch.zeros_like, params))


def update(
    params: Tree,
    grads: Tree,
    state: AdamWState,
    *,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
) -> tuple[Tree, AdamWState]:
    """One AdamW step: ``(new params, new state)``; the inputs are left as they were.

    The defaults are ``torch.optim.AdamW``'s. Its order: decay the
    parameter, update both moments, then one ``addcdiv`` with the
    bias-corrected step size.
    """
    beta1, beta2 = betas
    step = state.step + 1
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    decay = 1 - lr * weight_decay

    exp_avg = _map(lambda m, g: torch.lerp(m, g, 1 - beta1), state.exp_avg, grads)
    exp_avg_sq = _map(
        lambda v, g: torch.addcmul(v.mul(beta2), g, g, value=1 - beta2), state.exp_avg_sq, grads
    )

    def move(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        denom = (v.sqrt() / bias_correction2_sqrt).add(eps)
        return torch.addcdiv(p.mul(decay), m, denom, value=-step_size)

    return _map(move, params, exp_avg, exp_avg_sq), AdamWState(step, exp_avg, exp_avg_sq)
