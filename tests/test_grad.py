"""``fr.grad_and_value`` against ``torch.func.grad_and_value`` and the stateful backward."""

from __future__ import annotations

import collections
import copy
import threading
from collections import namedtuple
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import freplicate as fr
from freplicate import _leaves, _torch


class Model(nn.Module):
    """Tied weights, BatchNorm (buffers updated in train mode) and an unused parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 6, bias=False)
        self.bn = nn.BatchNorm1d(6)
        self.dec = nn.Linear(6, 4)
        self.out = nn.Linear(6, 4, bias=False)
        self.out.weight = self.dec.weight  # tied: the state holds it once, as dec.weight
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        h = torch.tanh(self.bn(self.emb(x)))
        return self.dec(h) * scale + self.out(h)


torch.manual_seed(0)
MODEL = Model()
STATE = fr.state(MODEL)
X = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(2))


def loss(
    params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, *, scale: float = 1.0
) -> torch.Tensor:
    out, _ = fr.apply(MODEL, fr.State(params, STATE.buffers), x, scale=scale)
    return F.cross_entropy(out, y)


def loss_aux(
    params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, Any]:
    out, new = fr.apply(MODEL, fr.State(params, STATE.buffers), x)
    return F.cross_entropy(out, y), {"buffers": new.buffers, "out": out}


def assert_same(actual: Any, expected: Any, *, exact: bool = False) -> None:
    a_leaves, a_spec = optree.tree_flatten(actual)
    e_leaves, e_spec = optree.tree_flatten(expected)
    assert a_spec == e_spec
    for a, e in zip(a_leaves, e_leaves):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.shape == e.shape and a.dtype == e.dtype
            if exact:
                assert torch.equal(a, e)
            else:
                torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-7)
        else:
            assert a == e


def snapshot(tree: Any) -> list[tuple[torch.Tensor, int, bool, torch.Tensor]]:
    return [
        (t, t._version, t.requires_grad, t.detach().clone())
        for t in optree.tree_leaves(tree)
        if isinstance(t, torch.Tensor)
    ]


def assert_unchanged(snap: list[tuple[torch.Tensor, int, bool, torch.Tensor]]) -> None:
    for t, version, rg, value in snap:
        assert t._version == version and t.requires_grad == rg and torch.equal(t, value)


def test_same_trees_and_values_as_torch_func_with_tied_batchnorm_unused() -> None:
    assert "out.weight" not in STATE.params  # the tied weight appears once
    snap = snapshot([STATE, X, Y, list(MODEL.parameters()), list(MODEL.buffers())])
    grads, value = fr.grad_and_value(loss)(STATE.params, X, Y)
    ref_grads, ref_value = torch.func.grad_and_value(loss)(STATE.params, X, Y)
    assert_same(grads, ref_grads)
    assert list(grads) == list(STATE.params)
    assert torch.equal(value, ref_value) and not value.requires_grad
    assert torch.equal(grads["unused.weight"], torch.zeros(3, 3))  # zeros, never None
    assert torch.equal(grads["unused.bias"], torch.zeros(3))
    assert_unchanged(snap)


def test_equals_the_stateful_backward() -> None:
    m = copy.deepcopy(MODEL)
    m.zero_grad(set_to_none=True)
    F.cross_entropy(m(X), Y).backward()
    grads, value = fr.grad_and_value(loss)(STATE.params, X, Y)
    for name, p in m.named_parameters():
        expected = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(grads[name], expected, msg=name)
    torch.testing.assert_close(value, F.cross_entropy(copy.deepcopy(MODEL)(X), Y))


def test_the_fast_path_runs_outside_transforms() -> None:
    levels: list[Any] = []

    def f(w: torch.Tensor) -> torch.Tensor:
        levels.append((_torch.transform_level(), w.requires_grad))
        return (w**2).sum()

    fr.grad_and_value(f)(torch.ones(2))
    assert levels == [(None, True)]  # plain autograd, no functorch level


def test_has_aux_returns_the_new_buffers() -> None:
    (grads, (value, aux)) = fr.grad_and_value(loss_aux, has_aux=True)(STATE.params, X, Y)
    ref_grads, (ref_value, ref_aux) = torch.func.grad_and_value(loss_aux, has_aux=True)(
        STATE.params, X, Y
    )
    assert_same(grads, ref_grads)
    assert_same(aux, ref_aux, exact=True)
    assert torch.equal(value, ref_value)
    assert int(aux["buffers"]["bn.num_batches_tracked"]) == 1
    assert not aux["out"].requires_grad
    stateful = copy.deepcopy(MODEL)
    stateful(X)
    for k, b in stateful.named_buffers():
        assert torch.equal(aux["buffers"][k], b), k


@pytest.mark.parametrize("argnums", [0, (0,), (0, 1), (1, 0), -3, 1])
def test_argnums(argnums: int | tuple[int, ...]) -> None:
    x = X.clone()
    grads, value = fr.grad_and_value(loss, argnums=argnums)(STATE.params, x, Y)
    ref_grads, ref_value = torch.func.grad_and_value(loss, argnums=argnums)(STATE.params, x, Y)
    assert_same(grads, ref_grads)
    assert isinstance(grads, tuple) == isinstance(argnums, tuple)
    assert torch.equal(value, ref_value) and x._version == 0


def test_kwargs_pass_through() -> None:
    grads, value = fr.grad_and_value(loss)(STATE.params, X, Y, scale=3.0)
    ref = torch.func.grad_and_value(loss)(STATE.params, X, Y, scale=3.0)
    assert_same((grads, value), ref)
    assert not torch.equal(value, fr.grad_and_value(loss)(STATE.params, X, Y)[1])


def test_nested_trees_and_repeated_leaves() -> None:
    w = torch.randn(3)

    def f(tree: Any, c: torch.Tensor) -> torch.Tensor:
        return (tree["a"][0] * c).sum() + tree["b"].w.sum() ** 2 + tree["a"][1].sum()

    W = namedtuple("W", "w")
    tree = {"a": [w, w], "b": W(torch.ones(2))}
    c = torch.randn(3)
    grads, _ = fr.grad_and_value(f)(tree, c)
    assert_same(grads, torch.func.grad_and_value(f)(tree, c)[0])
    # one tensor at two leaf positions: each position gets its own gradient
    assert torch.equal(grads["a"][0], c) and torch.equal(grads["a"][1], torch.ones(3))
    assert torch.equal(grads["b"].w, torch.full((2,), 4.0)) and type(grads["b"]) is W


def test_per_sample_gradients_under_vmap() -> None:
    m = nn.Linear(4, 4)  # per-sample: a model without batch statistics

    def one(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(m, params, (x[None],))
        return F.cross_entropy(out, y[None])

    params = {k: v.detach() for k, v in m.named_parameters()}
    got = torch.func.vmap(fr.grad_and_value(one), in_dims=(None, 0, 0))(params, X, Y)
    expected = torch.func.vmap(torch.func.grad_and_value(one), in_dims=(None, 0, 0))(params, X, Y)
    assert_same(got, expected)
    assert got[0]["weight"].shape == (8, 4, 4)


def test_composes_under_nested_grad() -> None:
    def inner(w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(x @ w["a"]) * w["b"]).sum()

    def grad_norm(g: Any) -> Any:
        def f(w: dict[str, torch.Tensor]) -> torch.Tensor:
            grads, _ = g(inner)(w, X)
            return sum((t**2).sum() for t in grads.values())  # type: ignore[return-value]

        return f

    w = {"a": torch.randn(4, 3), "b": torch.randn(3)}
    got = torch.func.grad(grad_norm(fr.grad_and_value))(w)
    expected = torch.func.grad(grad_norm(torch.func.grad_and_value))(w)
    assert_same(got, expected)
    assert got["a"].abs().sum() > 0


def test_inside_no_grad() -> None:
    with torch.no_grad():
        got = fr.grad_and_value(loss)(STATE.params, X, Y)
        expected = torch.func.grad_and_value(loss)(STATE.params, X, Y)
    assert_same(got, expected)
    assert got[0]["dec.weight"].abs().sum() > 0


def test_inputs_requiring_grad_keep_the_outer_graph() -> None:
    x = X.clone().requires_grad_()
    params = {k: v.clone().requires_grad_() for k, v in STATE.params.items()}
    grads, value = fr.grad_and_value(loss)(params, x, Y)
    ref_grads, ref_value = torch.func.grad_and_value(loss)(params, x, Y)
    assert_same(grads, ref_grads)
    assert grads["dec.weight"].requires_grad  # differentiable in the outer autograd
    outer = torch.autograd.grad(
        grads["dec.weight"].square().sum() + value, [x, params["emb.weight"]]
    )
    ref_outer = torch.autograd.grad(
        ref_grads["dec.weight"].square().sum() + ref_value, [x, params["emb.weight"]]
    )
    for a, b in zip(outer, ref_outer):
        torch.testing.assert_close(a, b)
    assert all(p.grad is None for p in params.values())  # nothing accumulated into .grad


def test_output_independent_of_the_parameters() -> None:
    def f(w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return x.sum()

    w = {"a": torch.ones(2, dtype=torch.float64), "b": torch.ones(())}
    grads, value = fr.grad_and_value(f)(w, torch.ones(3))
    assert_same((grads, value), torch.func.grad_and_value(f)(w, torch.ones(3)), exact=True)
    assert grads["a"].dtype == torch.float64


def test_non_scalar_output_raises() -> None:
    with pytest.raises(
        RuntimeError,
        match=r"^fr\.grad_and_value: expected f\(\*args\) to return a scalar tensor, got \(2,\)$",
    ):
        fr.grad_and_value(lambda w: w * 2)(torch.ones(2))
    with pytest.raises(RuntimeError, match=r"return a scalar tensor, got float$"):
        fr.grad_and_value(lambda w: 1.0)(torch.ones(2))
    with pytest.raises(
        RuntimeError,
        match=r"^fr\.grad_and_value\(f, has_aux=True\): f must return a \(output, aux\) tuple$",
    ):
        fr.grad_and_value(lambda w: w.sum(), has_aux=True)(torch.ones(2))
    # torch.func rejects the same calls
    with pytest.raises(RuntimeError, match="scalar"):
        torch.func.grad_and_value(lambda w: w * 2)(torch.ones(2))


def test_bad_argnums_and_leaves() -> None:
    with pytest.raises(
        TypeError,
        match=r"^fr\.grad_and_value: argnums must be an int or a non-empty tuple of ints, got \(\)$",
    ):
        fr.grad_and_value(loss, argnums=())
    with pytest.raises(TypeError, match=r"got \[0\]$"):
        fr.grad_and_value(loss, argnums=[0])  # type: ignore[arg-type]
    with pytest.raises(
        RuntimeError,
        match=r"^fr\.grad_and_value: argnums=3 is out of range for 3 positional argument\(s\)$",
    ):
        fr.grad_and_value(loss, argnums=3)(STATE.params, X, Y)
    with pytest.raises(
        RuntimeError,
        match=r"^fr\.grad_and_value: expected only tensors in args\[0\], got a leaf of type int at \[.n.\]$",
    ):
        fr.grad_and_value(lambda t: t["a"].sum())({"a": torch.ones(1), "n": 3})


def test_under_inference_mode_and_with_inference_tensors() -> None:
    # regression: inside inference_mode autograd records nothing even under enable_grad,
    # so the fast path returned zero gradients where torch.func returns the true ones;
    # and an inference tensor cannot be made to require grad outside inference_mode
    def f(w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (w * w * c).sum()

    c = torch.tensor([1.0, 2.0, 3.0])
    w = torch.tensor([1.0, -1.0, 0.5])
    with torch.inference_mode():
        got = fr.grad_and_value(f)(w, c)
        expected = torch.func.grad_and_value(f)(w, c)
        w_inf = w.clone()
    assert_same(got, expected, exact=True)
    assert torch.equal(got[0], 2 * w * c)
    assert w_inf.is_inference()
    assert_same(fr.grad_and_value(f)(w_inf, c), torch.func.grad_and_value(f)(w_inf, c), exact=True)


# --- small tensors of one shape differentiated as one stacked leaf (``_leaves.Leaves``) ---------


def _small_tree() -> dict[str, torch.Tensor]:
    """Small tensors of two shapes and dtypes, interleaved, and one too large to stack."""
    g = torch.Generator().manual_seed(3)
    tree = {}
    for i in range(9):
        if i % 2:
            tree[f"p{i}"] = torch.randn(3, generator=g, dtype=torch.float64)
        else:
            tree[f"p{i}"] = torch.randn(3, 3, generator=g)
    tree["p5_big"] = torch.randn(_leaves.STACK_NUMEL + 1, generator=g)
    return tree


def _small_objective(tree: dict[str, torch.Tensor], c: torch.Tensor) -> torch.Tensor:
    total = (tree["p5_big"] * 0.5).sum()
    for k, v in tree.items():
        if k in ("p2", "p7"):  # do not reach the output: zero gradients
            continue
        if k != "p5_big":
            total = total + (torch.sin(v.double() * c) * v.double()).sum()
    return total


def test_stacked_small_tensors_equal_torch_func_to_the_bit() -> None:
    tree = _small_tree()
    layout = _leaves.leaves_for(list(tree.values()))
    assert max(layout.sizes) > 1 and layout.make(list(tree.values())) is not None  # stacked
    versions = {k: v._version for k, v in tree.items()}
    c = torch.tensor(0.7, dtype=torch.float64)
    got = fr.grad_and_value(_small_objective)(tree, c)
    assert_same(got, torch.func.grad_and_value(_small_objective)(tree, c), exact=True)
    assert torch.equal(got[0]["p2"], torch.zeros(3, 3)) and got[0]["p7"].dtype == torch.float64
    assert {k: v._version for k, v in tree.items()} == versions
    with torch.no_grad():  # views of the stack must still track it
        got = fr.grad_and_value(_small_objective)(tree, c)
    assert_same(got, torch.func.grad_and_value(_small_objective)(tree, c), exact=True)
    # a transposed tensor would reach f contiguous, and sums round by strides: none stacked
    tree["p4"] = tree["p4"].t()
    assert _leaves.leaves_for(list(tree.values())).make(list(tree.values())) is None
    got = fr.grad_and_value(_small_objective)(tree, c)
    assert_same(got, torch.func.grad_and_value(_small_objective)(tree, c), exact=True)


def test_stacked_model_equals_the_stateful_backward() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(5, 5), nn.Tanh())])
    s = fr.state(model)
    assert max(_leaves.leaves_for(list(s.params.values())).sizes) == 6
    x = torch.randn(7, 5)

    def loss(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return fr.apply(model, fr.State(params, s.buffers), x)[0].pow(2).mean()

    grads, value = fr.grad_and_value(loss)(s.params)
    oracle = copy.deepcopy(model)
    ref_value = oracle(x).pow(2).mean()
    ref_value.backward()
    assert torch.equal(value, ref_value.detach())
    for k, p in oracle.named_parameters():
        assert torch.equal(grads[k], p.grad), k
    assert all(p.grad is None for p in model.parameters())


def test_sparse_and_integer_leaves_of_one_shape_behave_as_unstacked() -> None:
    a, b = torch.eye(3).to_sparse(), (2 * torch.eye(3)).to_sparse()

    def f(t: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.sparse.sum(t["a"] * 3) + torch.sparse.sum(t["b"])

    got = fr.grad_and_value(f)({"a": a, "b": b})
    expected = torch.func.grad_and_value(f)({"a": a, "b": b})
    for k in ("a", "b"):
        assert torch.equal(got[0][k].to_dense(), expected[0][k].to_dense())
    ints = {"i": torch.ones(2, dtype=torch.long), "j": torch.ones(2, dtype=torch.long)}
    with pytest.raises(
        RuntimeError, match=r"args\[0\]\[.i.\] has dtype torch.int64; only floating-point"
    ):
        fr.grad_and_value(lambda t: t["i"].sum())(ints)


def test_complex_values_and_tensor_subclasses_take_autograd_grad_itself() -> None:
    # the engine is called directly only for real scalars of plain tensors
    with pytest.raises(RuntimeError, match="only for real scalar outputs"):
        fr.grad_and_value(lambda w: (w * (1 + 2j)).sum())(torch.ones(2))

    calls: list[str] = []

    class Logged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.autograd.grad:
                calls.append("grad")
            return super().__torch_function__(func, types, args, kwargs or {})

    w = torch.tensor([1.0, 2.0]).as_subclass(Logged)
    got = fr.grad_and_value(lambda w: (w * w).sum())(w)
    expected = torch.func.grad_and_value(lambda w: (w * w).sum())(torch.tensor([1.0, 2.0]))
    assert calls == ["grad"]
    assert torch.equal(got[0].as_subclass(torch.Tensor), expected[0])
    assert torch.equal(got[1].as_subclass(torch.Tensor), expected[1])


def test_layouts_from_many_threads_at_once() -> None:
    # fr.data_parallel_grad differentiates from one thread per replica: the layout cache
    # (16 entries) is filled and evicted concurrently here, 8 threads x 12 layouts each
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def f(tree: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((torch.sin(v) * (i + 1)).sum() for i, v in enumerate(tree.values()))  # type: ignore[return-value]

    def work(seed: int) -> None:
        try:
            barrier.wait()
            for n in range(12):
                tree = {f"p{i}": torch.randn(seed + 1, n + 1) for i in range(9)}
                got = fr.grad_and_value(f)(tree)
                assert_same(got, torch.func.grad_and_value(f)(tree), exact=True)
        except BaseException as e:  # reported below, in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors, errors


def test_a_plain_dict_comes_back_in_its_own_key_order() -> None:
    # a dict of tensors skips optree: its gradients keep the dict's insertion order, as torch.func
    tree = {"b": torch.tensor(2.0), "a": torch.tensor(3.0), "c": torch.tensor(1.0)}

    def f(t: dict[str, torch.Tensor]) -> torch.Tensor:
        return t["a"] * t["b"] + t["c"]

    got = fr.grad_and_value(f)(tree)
    expected = torch.func.grad_and_value(f)(tree)
    assert list(got[0]) == list(expected[0]) == ["b", "a", "c"]
    assert_same(got, expected, exact=True)
    # a dict subclass or a nested dict takes optree's way, with the same answers
    for other in (collections.OrderedDict(tree), {**tree, "inner": {"d": torch.tensor(4.0)}}):
        assert_same(fr.grad_and_value(f)(other), torch.func.grad_and_value(f)(other), exact=True)


class _SparseAmongSameShapes(nn.Module):
    """A sparse embedding whose weight has the shape of eight dense weights (stacked together)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(3, 3, sparse=True)
        self.layers = nn.ModuleList([nn.Linear(3, 3, bias=False) for _ in range(8)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h.sum()


def test_a_sparse_gradient_among_stacked_leaves_equals_torch_func() -> None:
    torch.manual_seed(0)
    model = _SparseAmongSameShapes()
    params = fr.state(model).params
    idx = torch.tensor([0, 2, 2])

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return fr.apply(model, fr.State(p, {}), idx)[0]

    expected = torch.func.grad(lambda p: torch.func.functional_call(model, p, (idx,)))(params)
    for _ in range(2):  # the call that finds the sparse gradient, and one after it
        grads, _ = fr.grad_and_value(loss)(params)
        assert grads["emb.weight"].is_sparse
        for k in expected:
            torch.testing.assert_close(grads[k].to_dense(), expected[k].to_dense(), msg=k)


# --- decided per call, by types (issue 16) ----------------------------------------------


def test_a_bool_leaf_beside_one_that_requires_grad_is_named() -> None:
    params = {"w": torch.ones(2, requires_grad=True), "mask": torch.tensor([True, False])}
    with pytest.raises(RuntimeError, match=r"^fr\.grad_and_value: args\[0\]\['mask'\] has dtype torch\.bool"):
        fr.grad_and_value(lambda p: (p["w"] * p["mask"]).sum())(params)
    with pytest.raises(RuntimeError, match=r"^fr\.grad_and_value: args\[0\]\['mask'\] has dtype torch\.bool"):
        fr.grad_and_value(lambda p: (p["w"] * p["mask"]).sum())({**params, "w": torch.ones(2)})


class _Switching(nn.Module):
    """A first layer, a block checkpointed as ``mode`` says (shared with a plain layer), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.unused = nn.Linear(2, 2)
        self.mode = "plain"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.mode == "plain":
            h = self.block(h)
        else:
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.mode == "reentrant")
        return self.head(h + self.block(h))  # the block's weights also outside the checkpoint


def _stateful(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> dict[str, torch.Tensor]:
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for k, p in twin.named_parameters():
            p.copy_(params[k])
    twin(x.detach().requires_grad_(x.requires_grad)).square().sum().backward()
    return {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in twin.named_parameters()}


@pytest.mark.parametrize("input_requires_grad", [False, True])
def test_checkpointing_is_decided_per_call_not_per_function(input_requires_grad: bool) -> None:
    # One function, its module switching modes from call to call: each call is right. (The
    # answer was cached per code object: after a reentrant call, a non-reentrant one was refused.)
    torch.manual_seed(0)
    model = _Switching()
    params = {k: v + 0.1 for k, v in fr.state(model).params.items()}
    x = torch.randn(5, 4)

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fr.apply(model, fr.State(p, {}), x)[0].square().sum()

    g = fr.grad_and_value(f)
    for mode in ["reentrant", "plain", "non_reentrant", "reentrant", "non_reentrant", "plain"]:
        model.mode = mode
        xi = x.clone().requires_grad_() if input_requires_grad else x
        grads, _ = g(params, xi)
        want = _stateful(model, params, xi)
        for k in want:
            torch.testing.assert_close(grads[k], want[k], msg=f"{mode}: {k}")
        if input_requires_grad:
            assert xi.grad is None  # nothing of the caller's written
    assert all(p.grad is None for p in model.parameters())


def test_a_reentrant_checkpoint_below_an_input_that_requires_grad_gives_the_parameters_gradients() -> None:
    # The usual way to use a reentrant checkpoint on a first block: an input that requires grad.
    # torch.func refuses it; DDP's backward gives the parameters' gradients; so does fr.
    torch.manual_seed(0)
    block, head = nn.Linear(4, 4), nn.Linear(4, 1)
    model = nn.ModuleDict({"block": block, "head": head})
    params = fr.state(model).params
    x = torch.randn(3, 4, requires_grad=True)

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        inner = fr.State({k[6:]: v for k, v in p.items() if k.startswith("block.")}, {})
        h = torch.utils.checkpoint.checkpoint(
            lambda t: fr.apply(block, inner, t)[0], x, use_reentrant=True
        )
        return fr.apply(head, fr.State({k[5:]: v for k, v in p.items() if k.startswith("head.")}, {}), h)[0].sum()

    grads, _ = fr.grad_and_value(f)(params, x)
    twin = copy.deepcopy(model)
    twin["head"](torch.utils.checkpoint.checkpoint(twin["block"], x.detach().requires_grad_(), use_reentrant=True)).sum().backward()
    for k, p in twin.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, msg=k)
    assert x.grad is None and all(p.grad is None for p in model.parameters())
