"""fr.distributed composes with torch.func and autograd: drawn programs, trees and modules.

On 2 gloo ranks kept across examples and files (``fr.testing.RankPool``), each drawn
example is sent to both ranks (``_property_compose.py``), which compare:

* a drawn program (local maps, every collective, steps of every kind) on a
  drawn tree, under a drawn transform (vmap, grad, vjp, jvp, jacrev, jacfwd,
  hessian, autograd and double backward, three nestings), with the single-
  process simulation of both ranks differentiated by torch.func (JAX's
  convention: each rank gets the derivative of the sum over ranks);
* the same programs' forward and reverse rules against each other:
  ``sum_r <ct_r, J t> == sum_r <J^T ct, t_r>``;
* ``vmap`` of a step over an ensemble of a drawn module with DDP, member by
  member; second order on a drawn module (Hessian-vector products both
  ways, MAML's meta-gradient by torch.func and by autograd) with one process
  on every rank's inputs;
* a drawn program compiled (``backend="eager"``) and differentiated by
  autograd, with the simulation (a few examples: each one compiles).

Combinations with a known bug of their own (tests/test_compose.py marks
each xfail) are not drawn: ``skip`` under a transform that differentiates,
``accumulate`` under ``vmap``, ``weight=`` on a tree with a 0-dim leaf.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import optree
import pytest
import torch
from _property_compose import (
    TRANSFORMS,
    Stage,
    Staged,
    check_adjoint,
    check_compiled,
    check_ensemble,
    check_program,
    check_second_order,
    inputs_of,
)
from _property_ddp import WORLD, on_rank
from _property_support import bounded, examples
from hypothesis import given
from hypothesis import strategies as st

from freplicate.testing import RankPool, modules, trees

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


@pytest.fixture(scope="module")
def ranks(rank_pool: RankPool) -> Iterator[RankPool]:
    with bounded(rank_pool, 120.0) as pool:
        yield pool


OPS = st.sampled_from(["sum", "mean"])
CAPS = st.sampled_from([25.0, 1e-6])  # one bucket, or one a tensor
COMPRESS = st.sampled_from([None, None, "bf16"])
#: floating trees whose every leaf is a tensor (as torch.func sees them): dtypes mixed, views
#: (transposed, strided, offset, expanded), ties, empty and 0-dim tensors
TREES = trees(dtypes=(torch.float32, torch.float64), non_tensor_leaves=False, max_leaves=3).filter(
    lambda t: bool(optree.tree_leaves(t))
)
#: transforms that differentiate through a step: a skipping rank would run no rule (the bug)
SKIPPABLE = ("none", "vmap")
VMAPPED = ("vmap", "vmap_grad", "grad_vmap")


def _reducing(kind: str) -> st.SearchStrategy[Stage]:
    return st.builds(
        lambda op, cap, compress: Stage(kind, op=op, cap=cap, compress=compress),
        OPS,
        CAPS,
        COMPRESS,
    )


@st.composite
def stages(draw: Any, transform: str, tree: Any) -> list[Stage]:
    """A program for ``tree`` under ``transform``: 1 to 3 stages, none with a known bug there."""
    zero_dim = any(t.dim() == 0 for t in optree.tree_leaves(tree))
    methods = ["call"]
    if transform not in VMAPPED:
        methods.append("accumulate")
    if transform in SKIPPABLE:
        methods.append("skip")

    @st.composite
    def step(draw: Any) -> Stage:
        weighted = False if zero_dim else draw(st.booleans())
        op = "mean" if weighted else draw(OPS)
        method = draw(st.sampled_from(methods))
        shard = draw(st.booleans())
        return Stage("step", op=op, method=method, weighted=weighted, shard=shard, cap=draw(CAPS))

    stage = st.one_of(
        st.sampled_from([Stage("sin"), Stage("scale"), Stage("shard")]),
        _reducing("all_reduce"),
        st.integers(0, WORLD - 1).map(lambda src: Stage("broadcast", src=src)),
        _reducing("reduce_scatter"),
        step(),
    )
    return draw(st.lists(stage, min_size=1, max_size=3))


@examples(0.3)
@given(TREES, st.sampled_from(sorted(TRANSFORMS)), st.data())
def test_programs_under_transforms_equal_the_simulation(
    ranks: RankPool, tree: Any, transform: str, data: st.DataObject
):
    program = Staged(data.draw(stages(transform, tree), label="stages"))
    t = TRANSFORMS[transform]
    xs = inputs_of(tree, WORLD, 2 if t.batched else None, expanded=not t.forward)
    payload = {"program": program, "transform": transform, "inputs": xs}
    ranks.run(on_rank, check_program, payload)


@examples(0.2)
@given(TREES, st.data())
def test_transposes_are_the_adjoints_of_the_tangents(
    ranks: RankPool, tree: Any, data: st.DataObject
):
    program = Staged(data.draw(stages("jvp", tree), label="stages"))
    xs = inputs_of(tree, WORLD, None, expanded=False)
    ranks.run(on_rank, check_adjoint, {"program": program, "inputs": xs})


# DDP refuses a module without parameters; every other kind torch.func can differentiate
ENSEMBLE_KINDS = ["mlp", "conv", "tied", "buffers", "nested", "unused", "positional", "keywords"]


@examples(0.1)
@given(modules(kinds=ENSEMBLE_KINDS), st.data())
def test_vmap_of_a_step_over_an_ensemble_is_ddp_for_each_member(
    ranks: RankPool, pair: tuple[torch.nn.Module, Any], data: st.DataObject
):
    module, inputs = pair
    per_rank = [data.draw(inputs, label=f"inputs of rank {r}") for r in range(WORLD)]
    ranks.run(on_rank, check_ensemble, {"module": module, "inputs": per_rank})


@examples(0.2)
@given(
    modules(kinds=ENSEMBLE_KINDS, dtypes=(torch.float64,)),
    st.sampled_from(["hvp_forward", "hvp_reverse", "maml_func", "maml_autograd"]),
    st.data(),
)
def test_second_order_across_ranks_is_one_process_on_every_rank_s_inputs(
    ranks: RankPool, pair: tuple[torch.nn.Module, Any], how: str, data: st.DataObject
):
    module, inputs = pair
    per_rank = [data.draw(inputs, label=f"inputs of rank {r}") for r in range(WORLD)]
    ranks.run(on_rank, check_second_order, {"module": module, "inputs": per_rank, "how": how})


@examples(0.04)
@given(TREES, st.data())
def test_compiled_programs_under_autograd_equal_the_simulation(
    ranks: RankPool, tree: Any, data: st.DataObject
):
    program = Staged(data.draw(stages("autograd", tree), label="stages"))
    ranks.run(on_rank, check_compiled, {"program": program, "inputs": inputs_of(tree, WORLD, None)})
