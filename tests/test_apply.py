"""``fr.apply``'s binding where real training code strains it, against the stateful module.

Activation checkpointing (autograd recomputes the forward during backward),
compiled modules, modules changed between calls, leaks through the cache,
frozen parameters, checkpoints on disk, and the errors for malformed states.
Each test fails on the binding that unbound its skeleton when the forward
returned and tracked structure with process-wide registration hooks.
"""

from __future__ import annotations

import gc
import io
import re
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import freplicate as fr
from freplicate import _torch


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


class Checkpointed(nn.Module):
    """A first layer, a checkpointed block (either mode, or checkpoint_wrapper), a head."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(4, 4)
        self.block = checkpoint_wrapper(Block()) if mode == "wrapper" else Block()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.mode == "wrapper":
            h = self.block(h)
        else:
            h = cp.checkpoint(self.block, h, use_reentrant=self.mode == "reentrant")
        return self.head(h)


def shifted(model: nn.Module, by: float = 0.25) -> dict[str, torch.Tensor]:
    """Parameters unlike the module's own, so that reading the module's gives other values."""
    return {k: v + by for k, v in fr.state(model).params.items()}


def stateful_grads(
    model_fn: Callable[[], nn.Module], params: dict[str, torch.Tensor], x: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    ref = model_fn()
    load(ref, params)
    loss = ref(x).square().mean()
    loss.backward()
    return {k: p.grad for k, p in ref.named_parameters()}, loss.detach()  # type: ignore[misc]


def load(model: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Parameters by ``named_parameters()`` name (checkpoint_wrapper's state_dict renames them)."""
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(params[k])


MODES = ["non_reentrant", "reentrant", "wrapper"]


def build(mode: str) -> nn.Module:
    torch.manual_seed(0)
    return Checkpointed(mode)


@pytest.mark.parametrize("mode", MODES)
def test_checkpointing_under_fr_grad_and_value_equals_the_stateful_module(mode: str) -> None:
    model = build(mode)
    params = shifted(model)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    want, want_loss = stateful_grads(lambda: build(mode), params, x)

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out, _ = fr.apply(model, fr.State(p, {}), x)
        return out.square().mean()

    for _ in range(2):  # the first call and a warm one
        grads, value = fr.grad_and_value(loss)(params)
        for k in want:
            torch.testing.assert_close(grads[k], want[k], msg=k)
        torch.testing.assert_close(value, want_loss)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_checkpointing_under_backward_equals_the_stateful_module(mode: str) -> None:
    model = build(mode)
    params = shifted(model)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    want, _ = stateful_grads(lambda: build(mode), params, x)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    out, _ = fr.apply(model, fr.State(leaves, {}), x)
    out.square().mean().backward()
    for k in want:
        torch.testing.assert_close(leaves[k].grad, want[k], msg=k)
    if mode != "reentrant":  # autograd refuses .grad() through reentrant checkpoints
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        out, _ = fr.apply(model, fr.State(leaves, {}), x)
        got = torch.autograd.grad(out.square().mean(), list(leaves.values()))
        for k, g in zip(leaves, got):
            torch.testing.assert_close(g, want[k], msg=k)


def test_checkpointing_when_the_input_requires_grad() -> None:
    # fr.grad_and_value takes the create_graph route here (torch.func refuses saved-tensor
    # hooks); gradients still equal the stateful module's and stay differentiable in x
    model = build("non_reentrant")
    params = shifted(model)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3)).requires_grad_()
    want, _ = stateful_grads(lambda: build("non_reentrant"), params, x)

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fr.apply(model, fr.State(p, {}), x)[0].square().mean()

    grads, value = fr.grad_and_value(loss)(params, x)
    for k in want:
        torch.testing.assert_close(grads[k], want[k], msg=k)
    assert value.requires_grad  # attached to x's graph, as torch.func returns it
    (gx,) = torch.autograd.grad(grads["head.bias"].sum(), x)
    ref = build("non_reentrant")
    load(ref, params)
    (gb,) = torch.autograd.grad(ref(x).square().mean(), ref.head.bias, create_graph=True)
    (expected,) = torch.autograd.grad(gb.sum(), x)
    torch.testing.assert_close(gx, expected)


def test_checkpointing_under_data_parallel_grad() -> None:
    model = build("non_reentrant")
    params = shifted(model)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(4))

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fr.apply(model, fr.State(p, {}), x)[0].square().mean()

    grads, _ = fr.data_parallel_grad(loss, ["cpu", "cpu"])(params, x)
    halves = [stateful_grads(lambda: build("non_reentrant"), params, h)[0] for h in x.chunk(2)]
    for k in grads:
        torch.testing.assert_close(grads[k], (halves[0][k] + halves[1][k]) / 2, msg=k)


def test_a_skeleton_held_by_a_graph_is_not_reused_by_the_next_call() -> None:
    # the first call's graph is still alive (and will recompute) while a second call,
    # with other parameters, runs on the same module
    model = build("non_reentrant")
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(5))
    p1 = {k: v.clone().requires_grad_() for k, v in shifted(model, 0.1).items()}
    p2 = {k: v.clone().requires_grad_() for k, v in shifted(model, 0.7).items()}
    out1, _ = fr.apply(model, fr.State(p1, {}), x)
    out2, _ = fr.apply(model, fr.State(p2, {}), x)
    out1.square().mean().backward()
    out2.square().mean().backward()
    for p, by in ((p1, 0.1), (p2, 0.7)):
        want, _ = stateful_grads(lambda: build("non_reentrant"), shifted(model, by), x)
        for k in want:
            torch.testing.assert_close(p[k].grad, want[k], msg=k)


def test_compiled_module_uses_the_state() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    compiled = torch.compile(plain)
    s = fr.state(compiled)
    assert list(s.params) == [f"_orig_mod.{k}" for k, _ in plain.named_parameters()]
    params = {k: v + 0.5 for k, v in s.params.items()}
    x = torch.randn(5, 3)
    ref = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    ref.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in params.items()})
    out, _ = fr.apply(compiled, fr.State(params, {}), x)
    torch.testing.assert_close(out, ref(x))
    grads, _ = fr.grad_and_value(
        lambda p: fr.apply(compiled, fr.State(p, {}), x)[0].square().mean()
    )(params)
    ref(x).square().mean().backward()
    for k, p in ref.named_parameters():
        torch.testing.assert_close(grads[f"_orig_mod.{k}"], p.grad, msg=k)
    assert all(p.grad is None for p in plain.parameters())


def _compiled(how: str, backend: Any) -> nn.Module:
    """A model compiled as users compile: whole or a submodule, wrapped or in place."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    if how == "torch.compile(model)":
        return torch.compile(model, backend=backend)  # type: ignore[return-value]
    if how == "torch.compile(model[2])":
        model[2] = torch.compile(model[2], backend=backend)  # type: ignore[assignment]
    elif how == "model.compile()":
        model.compile(backend=backend)
    else:
        model[2].compile(backend=backend)
    return model


@pytest.mark.parametrize(
    "how",
    ["torch.compile(model)", "torch.compile(model[2])", "model.compile()", "model[2].compile()"],
)
def test_compiled_modules_and_submodules_compute_with_the_state(how: str) -> None:
    # a copy of a compiled (sub)module ran the compiled code of the original, on its tensors
    torch._dynamo.reset()
    backend = CompileCounter()  # counts the graphs it compiles, runs them as captured
    model = _compiled(how, backend)
    x = torch.randn(5, 3)
    for by in (0.5, -0.25, 1.0):  # new parameter tensors each call: compiled once for all
        params = {k: v + by for k, v in fr.state(model).params.items()}
        out, _ = fr.apply(model, fr.State(params, {}), x)
        torch.testing.assert_close(out, torch.func.functional_call(model, params, (x,)))
        grads, _ = fr.grad_and_value(lambda p: fr.apply(model, fr.State(p, {}), x)[0].sum())(params)
        want = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).sum())(params)
        torch.testing.assert_close(grads, want)
    if how.startswith("torch.compile"):  # fr.apply runs the compiled code, not its original
        assert backend.frame_count == 2, backend.frame_count  # one without grad, one with
    assert all(p.grad is None for p in model.parameters())


class Alternative(nn.Linear):
    def doubled(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_a_forward_set_on_the_module_object() -> None:
    lin = Alternative(3, 2)
    lin.forward = lin.doubled  # type: ignore[method-assign]  # a method of the module itself
    x, params = torch.randn(4, 3), {k: v + 1 for k, v in fr.state(lin).params.items()}
    out, _ = fr.apply(lin, fr.State(params, {}), x)
    torch.testing.assert_close(out, torch.func.functional_call(lin, params, (x,)))
    lin.forward = lambda x: nn.functional.linear(x, lin.weight, lin.bias)  # type: ignore[method-assign]
    with pytest.raises(
        TypeError,
        match=r"^fr\.apply: module\.forward is set on the module object \(function\) and may compute "
        r"with the module's own tensors, which fr\.apply cannot rebind; define it as a method",
    ):
        fr.apply(lin, fr.State(params, {}), x)


@pytest.mark.parametrize("how", ["torch.compile(model)", "torch.compile(model[2])"])
def test_without_the_compiled_module_lookup_a_compiled_module_is_refused_not_misrun(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a torch that moved OptimizedModule: its copy would run the original's compiled code
    model = _compiled(how, "eager")
    assert _torch.optimized_module_class() is type(
        model if how == "torch.compile(model)" else model[2]
    )
    monkeypatch.setattr(_torch, "optimized_module_class", lambda: None)
    fr.clear_caches()
    where = "module" if how == "torch.compile(model)" else "module.2"
    with pytest.raises(
        TypeError, match=rf"^fr\.apply: {re.escape(where)}\.forward is set on the module object"
    ):
        fr.apply(model, fr.state(model), torch.randn(2, 3))


@pytest.mark.parametrize("change", ["none", "del"])
def test_bias_removed_after_a_warm_call(change: str) -> None:
    lin = nn.Linear(3, 2)
    x = torch.ones(2, 3)
    fr.apply(lin, fr.state(lin), x)
    del lin.bias
    if change == "none":
        lin.register_parameter("bias", None)  # what `lin.bias = None` leaves
        out, _ = fr.apply(lin, fr.state(lin), x)
        torch.testing.assert_close(out, lin(x))
        assert list(fr.state(lin).params) == ["weight"]
    else:
        with pytest.raises(AttributeError, match="no attribute 'bias'"):  # as lin(x) itself
            lin(x)
        with pytest.raises(AttributeError, match="no attribute 'bias'"):
            fr.apply(lin, fr.state(lin), x)


def test_bias_given_again_after_it_was_removed_is_an_unknown_name() -> None:
    lin = nn.Linear(3, 2)
    old = fr.state(lin)
    fr.apply(lin, old, torch.ones(1, 3))
    lin.bias = None
    with pytest.raises(
        KeyError,
        match=r"state\.params has 'bias', which the module holds as None .*leave the name out",
    ):
        fr.apply(lin, old, torch.ones(1, 3))


def test_ties_and_children_changed_after_a_warm_call() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    x = torch.randn(2, 3)
    fr.apply(model, fr.state(model), x)
    model[2].weight = model[0].weight  # tied now
    s = fr.state(model)
    assert "2.weight" not in s.params
    params = {k: v + 1 for k, v in s.params.items()}
    out, _ = fr.apply(model, fr.State(params, {}), x)
    want = torch.func.functional_call(model, params, (x,))
    torch.testing.assert_close(out, want)
    model[1] = nn.ReLU()  # a tensorless child swapped
    out, _ = fr.apply(model, fr.State(params, {}), x)
    torch.testing.assert_close(out, torch.func.functional_call(model, params, (x,)))


def test_modules_built_between_calls_change_nothing() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    s = fr.state(model)
    x = torch.randn(2, 3)

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out, _ = fr.apply(model, fr.State(p, {}), x)
        return nn.MSELoss()(out, torch.zeros_like(out))  # a module built inside the loss

    from freplicate import _apply

    params = {k: v + 0.5 for k, v in s.params.items()}
    expected = torch.func.grad_and_value(
        lambda p: nn.MSELoss()(torch.func.functional_call(model, p, (x,)), torch.zeros(2, 3))
    )(params)
    fr.grad_and_value(loss)(params)
    plan = _apply._PLANS[model]
    got = fr.grad_and_value(loss)(params)
    torch.testing.assert_close(got, expected)
    assert _apply._PLANS[model] is plan  # the modules built in between kept the cache


class SelfHooked(nn.Linear):
    """A module whose forward hook is its own bound method: a cycle through its hooks."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.register_forward_hook(self.count)
        self.calls = 0

    def count(self, mod: nn.Module, args: Any, out: Any) -> None:
        self.calls += 1


def test_a_module_whose_hook_refers_to_itself_is_freed() -> None:
    model = SelfHooked()
    fr.apply(model, fr.state(model), torch.ones(1, 2))
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_clear_caches_drops_the_structure_cache() -> None:
    from freplicate import _apply

    model = nn.Linear(2, 2)
    fr.apply(model, fr.state(model), torch.ones(1, 2))
    assert model in _apply._PLANS
    fr.clear_caches()
    assert model not in _apply._PLANS
    out, _ = fr.apply(model, fr.state(model), torch.ones(1, 2))  # rebuilt
    torch.testing.assert_close(out, model(torch.ones(1, 2)))


MUST_BE_A_DICT = (
    r"must be a dict of name -> tensor, got {}; make the state with fr\.state\(module\)$"
)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (fr.State(None, None), r"^fr\.apply: state\.params " + MUST_BE_A_DICT.format("NoneType")),  # type: ignore[arg-type]
        (
            fr.State([torch.ones(1)], {}),
            r"^fr\.apply: state\.params " + MUST_BE_A_DICT.format("list"),
        ),  # type: ignore[arg-type]
        (fr.State({}, None), r"^fr\.apply: state\.buffers " + MUST_BE_A_DICT.format("NoneType")),  # type: ignore[arg-type]
        (
            fr.State({}, {"running_mean": 3}),
            r"^fr\.apply: state\.buffers\['running_mean'\] must be a tensor, got an int \(3\)$",
        ),  # type: ignore[dict-item]
        (
            fr.State({"weight": 2.0}, {}),
            r"^fr\.apply: state\.params\['weight'\] must be a tensor, got a float \(2\.0\)$",
        ),  # type: ignore[dict-item]
        (
            (torch.ones(1),),
            r"^fr\.apply: state must be an fr\.State\(params, buffers\), got tuple; make one with fr\.state\(module\)$",
        ),
    ],
)
def test_malformed_states_are_named(bad: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        fr.apply(nn.BatchNorm1d(2), bad, torch.ones(3, 2))


def test_fine_tuning_with_partition_leaves_frozen_parameters_alone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    trainable, frozen = fr.partition(fr.state(model).params, model)
    assert list(frozen) == ["0.weight", "0.bias"] and list(trainable) == ["2.weight", "2.bias"]
    before = {k: v.clone() for k, v in frozen.items()}
    x, y = torch.randn(6, 4), torch.randn(6, 2)

    def loss(t: dict[str, torch.Tensor]) -> torch.Tensor:
        out, _ = fr.apply(model, fr.State(fr.combine(t, frozen), {}), x)
        return (out - y).square().mean()

    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    ref[0].requires_grad_(False)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        grads, _ = fr.grad_and_value(loss)(trainable)
        assert list(grads) == list(trainable)  # nothing computed for the frozen layer
        trainable = {k: v - 0.1 * grads[k] for k, v in trainable.items()}
        opt.zero_grad()
        (ref(x) - y).square().mean().backward()
        opt.step()
    for k in before:
        assert torch.equal(frozen[k], before[k])
    for k, v in trainable.items():
        torch.testing.assert_close(v, ref.get_parameter(k))


def test_partition_and_combine_errors() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(
        KeyError, match=r"fr\.partition: params has 'nope', which is not a parameter"
    ):
        fr.partition({"nope": torch.ones(1)}, model)
    with pytest.raises(TypeError, match=r"fr\.partition: module must be an nn\.Module"):
        fr.partition({}, None)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"^fr\.combine: 'a' is in both parts\[0\] and parts\[2\]; give each name in one part only$",
    ):
        fr.combine({"a": torch.ones(1)}, {"b": torch.ones(1)}, {"a": torch.ones(1)})


def test_state_saves_and_loads_with_weights_only() -> None:
    model = nn.BatchNorm1d(3)
    s = fr.state(model)
    buf = io.BytesIO()
    torch.save(s, buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only=True, the default
    assert type(loaded) is fr.State
    for a, b in zip(
        (*loaded.params.values(), *loaded.buffers.values()),
        (*s.params.values(), *s.buffers.values()),
    ):
        assert torch.equal(a, b)


def test_grad_and_value_argument_errors() -> None:
    with pytest.raises(TypeError, match=r"^fr\.grad_and_value: fn must be callable, got NoneType$"):
        fr.grad_and_value(None)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"argnums elements must be unique, got \(0, 0\)"):
        fr.grad_and_value(lambda a: a.sum(), argnums=(0, 0))
    with pytest.raises(RuntimeError, match=r"argnums=\(0, -2\) names one argument twice"):
        fr.grad_and_value(lambda a, b: a.sum(), argnums=(0, -2))(torch.ones(1), torch.ones(1))
    with pytest.raises(RuntimeError, match=r"args\[0\]\['idx'\] has dtype torch\.int64"):
        fr.grad_and_value(lambda t: t["w"].sum())(
            {"w": torch.ones(2), "idx": torch.ones(2, dtype=torch.long)}
        )


def test_parameters_carrying_a_graph_warn_and_stay_differentiable() -> None:
    w0 = torch.ones(3, requires_grad=True)
    w = w0 * 2  # an update made with autograd on
    with pytest.warns(UserWarning, match=r"carries an autograd graph .* torch\.no_grad\(\)"):
        grads, _ = fr.grad_and_value(lambda w: (w**2).sum())(w)
    (g0,) = torch.autograd.grad(grads.sum(), w0)  # d/dw0 of sum(2 * (2 * w0)) = 4
    torch.testing.assert_close(g0, torch.full((3,), 4.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fr.grad_and_value(lambda w: (w**2).sum())(w.detach())  # the usual case: silent


def test_every_fast_path_is_on_with_the_pinned_torch() -> None:
    # if torch moved a private name, the fallback keeps freplicate right but slow: fail loudly
    assert {"maybe_current_level", "engine_run_backward", "storage_use_count"} <= set(
        _torch.FAST_PATHS
    )
    assert all(_torch.FAST_PATHS.values()), _torch.FAST_PATHS
    assert _torch.transform_level() is None
    seen: list[int | None] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append(_torch.transform_level())
        return x * 2

    torch.func.grad(f)(torch.tensor(0.0))
    assert seen and seen[0] is not None and seen[0] >= 1  # inside a transform: its level


def test_reentrant_checkpoint_below_a_closed_over_input_is_refused_not_zero() -> None:
    # autograd.grad with inputs skips a reentrant checkpoint that no input lies below: the
    # block's gradients came back zero; a full .backward() would write x.grad: refuse
    model = build("reentrant")
    x = torch.randn(5, 4).requires_grad_()

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        h = cp.checkpoint(model.block, x, use_reentrant=True)  # below x only
        return fr.apply(
            model.head, fr.State({k[5:]: v for k, v in p.items() if k.startswith("head.")}, {}), h
        )[0].sum()

    with pytest.raises(
        RuntimeError,
        match=r"use_reentrant=True, which autograd differentiates only with a full \.backward\(\)",
    ):
        fr.grad_and_value(loss)(shifted(model))
    assert x.grad is None
