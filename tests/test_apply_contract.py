"""``fr.apply``'s contract, row by row, eager and compiled, against ``functional_call`` and the module.

Each row of the table in docs/apply.md is a test run in both modes:
``eager`` (``fr.apply`` itself) and ``compiled`` (a function that calls
``fr.apply``, compiled with ``torch.compile(..., fullgraph=True)`` by
Dynamo's ``CompileCounter``, which runs the captured graph as the ``"eager"``
backend does and counts the graphs, so that a call that fell back to eager
code fails the test).
The references are the stateful module (a deep copy holding the state's
values, driven as PyTorch drives it) and ``torch.func.functional_call`` on
the same inputs. An error is the same exception eager and under
``fullgraph=False``; under ``fullgraph=True`` Dynamo reports any error
raised while it traces as its own, carrying fr.apply's message, which the
tests match.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

import freplicate as fr
from freplicate.testing._strategies import Output

MODES = ["eager", "compiled"]


def run(mode: str, module: nn.Module, state: fr.State, *args: Any, **kwargs: Any) -> Any:
    """``fr.apply(module, state, *args, **kwargs)`` in ``mode``; compiled: one graph, no break."""
    if mode == "eager":
        return fr.apply(module, state, *args, **kwargs)
    torch._dynamo.reset()  # a trace of its own, never a cache entry of another test's module
    graphs = CompileCounter()  # counts the graphs it compiles, runs them as captured

    def step(state: fr.State, args: Any, kwargs: Any) -> Any:
        return fr.apply(module, state, *args, **kwargs)

    out = torch.compile(step, backend=graphs, fullgraph=True)(state, args, kwargs)
    assert graphs.frame_count == 1, f"{graphs.frame_count} graphs"
    return out


def raises(mode: str, kind: type[Exception], pattern: str) -> Any:
    """The error eager; under ``fullgraph=True`` Dynamo's, with the same message in it."""
    if mode == "eager":
        return pytest.raises(kind, match=pattern)
    return pytest.raises(Exception, match=f"(?s).*{pattern}")


def snapshot(*trees: Any) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    tensors = [
        t
        for tree in trees
        for t in torch.utils._pytree.tree_leaves(tree)
        if isinstance(t, torch.Tensor)
    ]
    return [(t, t._version, t.detach().clone()) for t in tensors]


def unchanged(snap: list[tuple[torch.Tensor, int, torch.Tensor]]) -> None:
    for t, version, value in snap:
        assert t._version == version
        assert torch.equal(t, value)


def tensors_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }


def holding(module: nn.Module, values: dict[str, torch.Tensor]) -> nn.Module:
    """The stateful oracle: a deep copy of ``module`` with ``values`` copied into its tensors."""
    c = copy.deepcopy(module)
    with torch.no_grad():
        for k, v in values.items():
            (c.get_parameter(k) if k in dict(c.named_parameters()) else c.get_buffer(k)).copy_(v)
    return c


def shifted(module: nn.Module, by: float = 0.5) -> fr.State:
    """A state whose floating-point tensors differ from the module's own."""
    s = fr.state(module)
    return fr.State(
        {k: v + by for k, v in s.params.items()},
        {k: v + by if v.is_floating_point() else v.clone() for k, v in s.buffers.items()},
    )


class Net(nn.Module):
    """A Linear, a BatchNorm (statistics updated in place) and a buffer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("offset", torch.tensor([0.5, -0.5, 0.0, 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x)) + self.offset


class Ema(nn.Module):
    """A forward that reassigns its buffer, EMA-style (a new tensor, not an in-place update)."""

    avg: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("avg", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.avg = 0.5 * self.avg + 0.5 * y.detach().mean(0)
        return y - self.avg


class Tied(nn.Module):
    """One weight under two names, the first (canonical) one a bias-free embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx))


class Shared(nn.Module):
    """One block reachable under three names, and its buffer with it."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
        self.again = self.block
        self.also = nn.ModuleList([self.block])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.again(torch.tanh(self.block(x)))


class Child(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Cyclic(nn.Module):
    """A child that refers back to its parent: a cycle in the module graph."""

    def __init__(self) -> None:
        super().__init__()
        self.child = Child()
        self.child.parent = self
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.child(x))


def build(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls()


X = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
IDX = torch.tensor([[0, 3], [4, 1]])


# --- rows ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("training", [True, False])
def test_a_full_state_computes_what_the_module_and_functional_call_compute(
    mode: str, training: bool
) -> None:
    m = build(Net).train(training)
    s = shifted(m)
    guard = snapshot(s, tensors_of(m))
    out, new = run(mode, m, s, X)
    unchanged(guard)
    oracle = holding(m, {**s.params, **s.buffers})
    torch.testing.assert_close(out, oracle(X))
    flat = {k: v.clone() for k, v in {**s.params, **s.buffers}.items()}
    torch.testing.assert_close(out, torch.func.functional_call(m, flat, (X,)))
    assert new.params is s.params
    assert list(new.buffers) == list(s.buffers)
    torch.testing.assert_close(new.buffers, dict(oracle.named_buffers()))
    torch.testing.assert_close(new.buffers, {k: flat[k] for k in s.buffers})  # functional_call's
    if not training:
        torch.testing.assert_close(new.buffers, s.buffers)


@pytest.mark.parametrize("mode", MODES)
def test_missing_names_fall_back_to_the_modules_tensors(mode: str) -> None:
    m = build(Net)
    full = shifted(m)
    partial = fr.State(
        {"lin.weight": full.params["lin.weight"]}, {"offset": full.buffers["offset"]}
    )
    guard = snapshot(partial, tensors_of(m))
    out, new = run(mode, m, partial, X)
    unchanged(guard)  # the module's own buffers were cloned before BatchNorm updated them
    oracle = holding(m, {"lin.weight": full.params["lin.weight"], "offset": full.buffers["offset"]})
    torch.testing.assert_close(out, oracle(X))
    given = {"lin.weight": full.params["lin.weight"], "offset": full.buffers["offset"].clone()}
    torch.testing.assert_close(out, torch.func.functional_call(copy.deepcopy(m), given, (X,)))
    assert list(new.buffers) == [
        "offset",
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
    ]
    torch.testing.assert_close(new.buffers, dict(oracle.named_buffers()))


@pytest.mark.parametrize("mode", MODES)
def test_an_unknown_name_is_a_key_error_naming_it(mode: str) -> None:
    m = build(Net)
    s = fr.state(m)
    typo = fr.State({**s.params, "lin.wieght": torch.ones(4, 3)}, s.buffers)
    with raises(
        mode,
        KeyError,
        r"fr\.apply: state\.params has 'lin\.wieght', which the module does not have",
    ):
        run(mode, m, typo, X)
    with raises(
        mode,
        KeyError,
        r"fr\.apply: state\.buffers has 'bn\.mean', which the module does not have \(nor \['x'\]\)",
    ):
        run(mode, m, fr.State({}, {"bn.mean": torch.ones(4), "x": torch.ones(1)}), X)
    with pytest.raises(
        RuntimeError, match="Unexpected key"
    ):  # functional_call ignores it unless strict
        torch.func.functional_call(m, {**typo.params, **typo.buffers}, (X,), strict=True)


@pytest.mark.parametrize("mode", MODES)
def test_a_name_in_both_params_and_buffers_is_a_value_error_naming_it(mode: str) -> None:
    m = build(Net)
    s = fr.state(m)
    both = fr.State(s.params, {**s.buffers, "lin.bias": torch.zeros(4)})
    with raises(
        mode,
        ValueError,
        r"fr\.apply: 'lin\.bias' is in both state\.params and state\.buffers; give each name once",
    ):
        run(mode, m, both, X)
    with pytest.raises(ValueError, match="appeared in multiple dictionaries"):
        torch.func.functional_call(m, (both.params, both.buffers), (X,))


@pytest.mark.parametrize("mode", MODES)
def test_buffers_reassigned_in_forward_come_back_new(mode: str) -> None:
    m = build(Ema)
    oracle = copy.deepcopy(m)
    s = fr.state(m)
    given = s
    guard = snapshot(s, tensors_of(m))
    for i in range(3):
        out, s = run(mode, m, s, X + i)
        torch.testing.assert_close(out, oracle(X + i))
        torch.testing.assert_close(s.buffers, dict(oracle.named_buffers()))
    unchanged(guard)
    assert torch.equal(m.avg, torch.zeros(3)) and torch.equal(given.buffers["avg"], torch.zeros(3))
    bound = {**given.params, "avg": given.buffers["avg"].clone()}
    torch.func.functional_call(m, bound, (X,))  # functional_call writes the new value back
    assert not torch.equal(bound["avg"], torch.zeros(3))


@pytest.mark.parametrize("mode", MODES)
def test_tied_names_take_either_name_and_two_tensors_are_refused_naming_both(mode: str) -> None:
    m = build(Tied)
    w = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))
    want = w[IDX] @ w.t()
    for name in ("emb.weight", "out.weight"):
        out, _ = run(mode, m, fr.State({name: w}, {}), IDX)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(out, torch.func.functional_call(m, {name: w}, (IDX,)))
    out, _ = run(mode, m, fr.State({"emb.weight": w, "out.weight": w}, {}), IDX)
    torch.testing.assert_close(out, want)
    for first, second in (("emb.weight", "out.weight"), ("out.weight", "emb.weight")):
        two = fr.State({first: w, second: w + 1}, {})
        pattern = rf"fr\.apply: state\.params gives different tensors for the tied names '{re.escape(first)}' and '{re.escape(second)}'"
        with raises(mode, ValueError, pattern):
            run(mode, m, two, IDX)


@pytest.mark.parametrize("mode", MODES)
def test_a_submodule_under_several_names_is_bound_once_and_the_module_left_alone(mode: str) -> None:
    m = build(Shared)
    names = [k for k, _ in m.named_parameters(remove_duplicate=False)]
    assert names == [
        f"{p}.{i}.{w}"
        for p in ("block", "again", "also.0")
        for i in (0, 1)
        for w in ("weight", "bias")
    ]
    own = tensors_of(m)
    s = shifted(m)
    guard = snapshot(s, own)
    out, new = run(mode, m, s, X)
    unchanged(guard)
    assert all(t is own[k] for k, t in tensors_of(m).items())  # the module holds its own again
    oracle = holding(m, {**s.params, **s.buffers})
    torch.testing.assert_close(out, oracle(X))
    torch.testing.assert_close(new.buffers, dict(oracle.named_buffers()))
    # any of the names binds the block: here the last one
    last = {k.replace("block.", "also.0."): v for k, v in s.params.items()}
    torch.testing.assert_close(run(mode, m, fr.State(last, s.buffers), X)[0], out)


def test_functional_call_leaves_a_shared_submodule_holding_the_given_tensors() -> None:
    # why the traced binding names each place a tensor sits once, with tie_weights=False
    m = build(Shared)
    before = m.block[0].weight
    given = {k: v.clone() for k, v in fr.state(m).params.items()}
    torch.func.functional_call(m, given, (X,))
    assert m.block[0].weight is given["block.0.weight"] and m.block[0].weight is not before


@pytest.mark.parametrize("mode", MODES)
def test_a_module_graph_with_a_cycle_works(mode: str) -> None:
    m = build(Cyclic)
    s = shifted(m)
    assert list(s.params) == ["child.lin.weight", "child.lin.bias", "head.weight", "head.bias"]
    out, new = run(mode, m, s, X)
    torch.testing.assert_close(out, holding(m, s.params)(X))
    torch.testing.assert_close(
        out, torch.func.functional_call(m, s.params, (X,), tie_weights=False)
    )
    assert new.buffers == {}


@pytest.mark.parametrize("mode", MODES)
def test_training_is_honoured_between_calls(mode: str) -> None:
    m = build(Net)
    s = shifted(m)
    for training in (True, False, True):
        m.train(training)
        out, new = run(mode, m, s, X)
        oracle = holding(m, {**s.params, **s.buffers})
        torch.testing.assert_close(out, oracle(X))
        torch.testing.assert_close(new.buffers, dict(oracle.named_buffers()))


@pytest.mark.parametrize("mode", MODES)
def test_gradients_through_apply_equal_the_modules(mode: str) -> None:
    m = build(Net)
    s = shifted(m)
    leaves = {k: v.clone().requires_grad_() for k, v in s.params.items()}
    out, _ = run(mode, m, fr.State(leaves, s.buffers), X)
    out.square().mean().backward()
    oracle = holding(m, {**s.params, **s.buffers})
    oracle(X).square().mean().backward()
    for k, p in oracle.named_parameters():
        torch.testing.assert_close(leaves[k].grad, p.grad, msg=k)
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["script", "trace"])
def test_torchscript_modules_are_refused_naming_fr_apply(mode: str, how: str) -> None:
    m = build(Child)
    jitted = torch.jit.script(m) if how == "script" else torch.jit.trace(m, X)
    # Dynamo refuses a scripted module itself, in words of its own, before fr.apply runs
    theirs = (
        "|torch.jit.script/freeze modules unsupported"
        if (mode, how) == ("compiled", "script")
        else ""
    )
    ours = r"fr\.apply: module is a TorchScript module .*pass the nn\.Module it was made from"
    with raises(mode, TypeError, f"({ours}{theirs})"):
        run(mode, jitted, fr.state(jitted), X)
    outer = nn.Sequential(nn.Linear(3, 3), jitted)
    with raises(mode, TypeError, rf"(fr\.apply: module\.1 is a TorchScript module{theirs})"):
        run(mode, outer, fr.State({}, {}), X)
    with pytest.raises(RuntimeError, match="can't be used with Jitted modules"):
        torch.func.functional_call(jitted, fr.state(jitted).params, (X,))


@pytest.mark.parametrize("mode", MODES)
def test_a_non_tensor_in_the_state_is_named(mode: str) -> None:
    m = build(Net)
    s = fr.state(m)
    with raises(
        mode,
        TypeError,
        r"fr\.apply: state\.params\['lin\.bias'\] must be a tensor, got a float \(2\.0\)",
    ):
        run(mode, m, fr.State({**s.params, "lin.bias": 2.0}, s.buffers), X)  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("make", "kind", "pattern"),
    [
        (
            lambda m, s: fr.State({**s.params, "lin.wieght": torch.ones(1)}, s.buffers),
            KeyError,
            "has 'lin.wieght'",
        ),
        (
            lambda m, s: fr.State(s.params, {**s.buffers, "lin.bias": torch.ones(4)}),
            ValueError,
            "in both state.params",
        ),
    ],
)
def test_without_fullgraph_a_compiled_call_raises_the_eager_exception(
    make: Callable[[nn.Module, fr.State], fr.State], kind: type[Exception], pattern: str
) -> None:
    m = build(Net)
    torch._dynamo.reset()
    step = torch.compile(lambda s, x: fr.apply(m, s, x), backend="eager")
    with pytest.raises(kind, match=re.escape(pattern)):
        step(make(m, fr.state(m)), X)


@pytest.mark.parametrize("mode", MODES)
def test_a_parametrized_module_binds_the_parametrization_s_tensors(mode: str) -> None:
    from torch.nn.utils import parametrizations

    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    parametrizations.weight_norm(m[0])
    s = shifted(m, 0.3)
    assert "0.parametrizations.weight.original0" in s.params
    out, _ = run(mode, m, s, X)
    torch.testing.assert_close(out, torch.func.functional_call(m, s.params, (X,)))
    torch.testing.assert_close(out, holding(m, s.params)(X))


@pytest.mark.parametrize("mode", MODES)
def test_none_in_the_state_is_bound_as_functional_call_binds_it(mode: str) -> None:
    m = build(Net)
    s = shifted(m)
    # a Linear without its bias, a BatchNorm normalising by the batch's statistics
    params = {**s.params, "lin.bias": None}
    buffers = {**s.buffers, "bn.running_mean": None, "bn.running_var": None}
    state = fr.State(params, buffers)  # type: ignore[arg-type]
    guard = snapshot(s, tensors_of(m))
    out, new = run(mode, m, state, X)
    unchanged(guard)
    given = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in buffers.items()}
    torch.testing.assert_close(out, torch.func.functional_call(m, {**params, **given}, (X,)))
    oracle = holding(m, {k: v for k, v in {**params, **buffers}.items() if v is not None})
    oracle.lin.bias = None
    oracle.bn.running_mean = oracle.bn.running_var = None
    torch.testing.assert_close(out, oracle(X))
    assert new.params is params
    assert new.buffers["bn.running_mean"] is None and new.buffers["bn.running_var"] is None
    assert int(new.buffers["bn.num_batches_tracked"]) == int(oracle.bn.num_batches_tracked)
    assert m.lin.bias is not None and m.bn.running_mean is not None  # the module is left alone
    # and again from the new state: None stays bound
    torch.testing.assert_close(run(mode, m, new, X)[0], oracle(X))


@pytest.mark.parametrize("mode", MODES)
def test_gradients_flow_past_a_none_in_the_state(mode: str) -> None:
    m = build(Net).eval()
    s = shifted(m)
    leaves = {k: v.clone().requires_grad_() for k, v in s.params.items() if k != "lin.bias"}
    out, _ = run(mode, m, fr.State({**leaves, "lin.bias": None}, s.buffers), X)  # type: ignore[dict-item]
    out.square().mean().backward()
    oracle = holding(m, {**leaves, **s.buffers})
    oracle.lin.bias = None
    oracle(X).square().mean().backward()
    for k, p in oracle.named_parameters():
        torch.testing.assert_close(leaves[k].grad, p.grad, msg=k)


@pytest.mark.parametrize("mode", MODES)
def test_a_name_the_module_holds_as_none_is_a_key_error_saying_so(mode: str) -> None:
    m = nn.Sequential(nn.Linear(3, 2, bias=False))
    w = fr.state(m).params["0.weight"]
    for value in (torch.ones(2), None):
        with raises(
            mode,
            KeyError,
            r"fr\.apply: state\.params has '0\.bias', which the module holds as None .*"
            r"leave the name out",
        ):
            run(mode, m, fr.State({"0.weight": w, "0.bias": value}, {}), X)  # type: ignore[dict-item]
    # functional_call sets the tensor there: a bias the module does not have
    with_bias = torch.func.functional_call(m, {"0.bias": torch.ones(2)}, (X,))
    torch.testing.assert_close(with_bias, m(X) + 1)


@pytest.mark.parametrize("mode", MODES)
def test_names_through_a_cycle_reach_the_tensor_at_their_end(mode: str) -> None:
    m = build(Cyclic)
    s = shifted(m)
    through = {
        "child.parent.head.weight": s.params["head.weight"],
        "child.parent.child.lin.bias": s.params["child.lin.bias"],
    }
    out, _ = run(mode, m, fr.State(through, {}), X)
    want = holding(
        m, {"head.weight": s.params["head.weight"], "child.lin.bias": s.params["child.lin.bias"]}
    )
    torch.testing.assert_close(out, want(X))
    torch.testing.assert_close(out, torch.func.functional_call(m, through, (X,), tie_weights=False))
    with raises(
        mode,
        ValueError,
        r"different tensors for the tied names 'child\.parent\.head\.weight' and 'head\.weight'",
    ):
        run(mode, m, fr.State({**through, "head.weight": s.params["head.weight"] + 1}, {}), X)
    with raises(mode, KeyError, r"state\.params has 'child\.parent\.nothing\.weight', which"):
        run(mode, m, fr.State({"child.parent.nothing.weight": torch.ones(1)}, {}), X)


class Members(nn.Module):
    """A forward that returns members of the module beside its output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor, what: str) -> Any:
        y = self.bn(self.lin(x))
        member = {
            "parameter": lambda: self.lin.weight,
            "buffer": lambda: self.bn.running_mean,
            "submodule": lambda: self.lin,
            "module": lambda: self,
            "in a container": lambda: Output(logits=y, hidden=[self.bn]),
        }[what]()
        return y, member


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("what", ["parameter", "buffer", "submodule", "module", "in a container"])
def test_members_returned_from_forward_are_what_functional_call_returns(
    mode: str, what: str
) -> None:
    m = build(Members)
    s = shifted(m)
    own = tensors_of(m)
    out, new = run(mode, m, s, X, what)
    given = {**s.params, **{k: v.clone() for k, v in s.buffers.items()}}
    theirs = torch.func.functional_call(m, given, (X, what))
    torch.testing.assert_close(out[0], theirs[0])
    member = out[1]
    if what == "parameter":  # the state's tensor
        assert member is s.params["lin.weight"] and theirs[1] is given["lin.weight"]
    elif what == "buffer":  # its value after the forward: the new state's tensor
        assert member is new.buffers["bn.running_mean"]
        torch.testing.assert_close(member, theirs[1])
    elif what == "in a container":  # the module itself, as functional_call returns it
        assert type(member) is Output and member.hidden[0] is m.bn is theirs[1].hidden[0]
    else:  # the module itself, holding its own tensors again, as functional_call returns it
        assert member is theirs[1] is (m.lin if what == "submodule" else m)
    assert all(t is own[k] for k, t in tensors_of(m).items())
