"""Randomness: dropout under a seed gives one answer, run after run.

In one process ``fr.apply`` draws the numbers the stateful module draws
(same seed, same ops, same order), so its gradients equal the module's. Under
``fr.data_parallel`` / ``fr.data_parallel_grad`` the replicas run in threads
at once: however they draw (each from a generator of its own, derived from
the caller's), the same seed must give bit-identical outputs, gradients and
losses every time, whatever the threads' timing.
"""

from __future__ import annotations

from typing import Any

import torch
from _property_oracle import HOWS, How, check_gradients, mean_loss, problem
from _property_support import split_inputs, trainable, weighted_loss
from hypothesis import given
from hypothesis import strategies as st

import freplicate as fr
from freplicate.testing import assert_trees_close, devices, modules

dropout = modules(kinds=["dropout"], dtypes=(torch.float32, torch.float64), training=True)
SEEDS = st.integers(0, 2**16)
# several replicas, so that their threads can race
REPLICAS = devices(max_size=4).filter(lambda d: len(d) >= 2)
RUNS = 6


@given(dropout, SEEDS, SEEDS, st.sampled_from(HOWS), st.data())
def test_gradients_through_apply_equal_the_stateful_module_under_one_seed(
    pair: tuple[torch.nn.Module, Any], seed: int, rng_seed: int, how: How, data: st.DataObject
):
    module, inputs = pair
    x = data.draw(inputs, label="inputs")
    p = problem(module, x, values_seed=seed, rng_seed=rng_seed, wrt_inputs=True)
    check_gradients(p, how)


def _runs(seed: int, step: Any) -> list[Any]:
    results = []
    for _ in range(RUNS):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            results.append(step())
    return results


def _all_equal(results: list[Any], what: str) -> None:
    for i, r in enumerate(results[1:], 1):
        try:
            assert_trees_close(r, results[0], rtol=0, atol=0)
        except AssertionError as err:
            raise AssertionError(
                f"{what}: run {i} differs from run 0 under one seed: {err}"
            ) from None


@given(dropout, REPLICAS, SEEDS, st.data())
def test_data_parallel_under_a_seed_is_reproducible(
    pair: tuple[torch.nn.Module, Any], devs: list[str], seed: int, data: st.DataObject
):
    module, inputs = pair
    args, kwargs = split_inputs(data.draw(inputs, label="inputs"))
    s = fr.state(module)

    def step() -> Any:
        params = {k: v.detach().requires_grad_() for k, v in trainable(module, s.params).items()}
        out, _ = fr.data_parallel(
            module, fr.State(params, s.buffers), *args, devices=devs, **kwargs
        )
        grads = torch.autograd.grad(weighted_loss(out), list(params.values()), allow_unused=True)
        return out.detach(), [g for g in grads if g is not None]

    _all_equal(_runs(seed, step), "fr.data_parallel")


@given(dropout, REPLICAS, SEEDS, st.data())
def test_data_parallel_grad_under_a_seed_is_reproducible(
    pair: tuple[torch.nn.Module, Any], devs: list[str], seed: int, data: st.DataObject
):
    module, inputs = pair
    args, _ = split_inputs(data.draw(inputs, label="inputs"))
    s = fr.state(module)

    def loss_fn(params: dict[str, torch.Tensor], *batch: torch.Tensor) -> torch.Tensor:
        out, _ = fr.apply(module, fr.State(params, s.buffers), *batch)
        return mean_loss(out)

    step = fr.data_parallel_grad(loss_fn, devs)
    _all_equal(_runs(seed, lambda: step(s.params, *args)), "fr.data_parallel_grad")
