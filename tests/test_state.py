"""``fr.state`` and ``fr.apply`` against the stateful module and ``torch.func.functional_call``."""

from __future__ import annotations

import copy
import gc
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import optree
import pytest
import torch
from torch import nn

import freplicate as fr


class Net(nn.Module):
    """Conv, BatchNorm (running stats and num_batches_tracked), dropout, an own buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3)
        self.bn = nn.BatchNorm1d(3)
        self.drop = nn.Dropout(0.0)
        self.head = nn.Linear(12, 2)
        self.register_buffer("offset", torch.tensor([0.5, -0.5]))
        self.register_buffer("scratch", torch.zeros(1), persistent=False)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        h = self.drop(self.bn(self.conv(x)).relu())
        return self.head(h.flatten(1)) * scale + self.offset


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.out = nn.Linear(4, 5, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx))


def net() -> Net:
    torch.manual_seed(0)
    return Net()


def x_net(seed: int = 1) -> torch.Tensor:
    return torch.randn(5, 2, 6, generator=torch.Generator().manual_seed(seed))


def snapshot(tensors: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    return [(t, t._version, t.detach().clone()) for t in tensors]


def assert_unchanged(snap: list[tuple[torch.Tensor, int, torch.Tensor]]) -> None:
    for t, version, value in snap:
        assert t._version == version
        assert torch.equal(t, value)


def module_tensors(m: nn.Module) -> list[torch.Tensor]:
    return [*m.parameters(), *m.buffers()]


def perturbed(m: nn.Module, seed: int) -> fr.State:
    """A state unlike the module's own (every float tensor shifted), same names."""
    g = torch.Generator().manual_seed(seed)
    s = fr.state(m)
    shift = {k: v + torch.randn(v.shape, generator=g) for k, v in s.params.items()}
    bufs = {
        k: v + torch.rand(v.shape, generator=g) if v.is_floating_point() else v + seed
        for k, v in s.buffers.items()
    }
    return fr.State(shift, bufs)


def load(m: nn.Module, s: fr.State) -> nn.Module:
    """The stateful oracle: a deep copy of ``m`` holding ``s``'s values."""
    c = copy.deepcopy(m)
    with torch.no_grad():
        for k, v in {**s.params, **s.buffers}.items():
            c.get_parameter(k).copy_(v) if k in s.params else c.get_buffer(k).copy_(v)
    return c


# --- fr.state


def test_state_is_zero_copy_and_detached() -> None:
    m = net()
    s = fr.state(m)
    assert list(s.params) == [k for k, _ in m.named_parameters()]
    assert list(s.buffers) == [
        "offset",
        "scratch",  # non-persistent buffers too
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
    ]
    for k, t in {**s.params, **s.buffers}.items():
        own = m.get_parameter(k) if k in s.params else m.get_buffer(k)
        assert t.data_ptr() == own.data_ptr() and t.shape == own.shape
        assert type(t) is torch.Tensor and not t.requires_grad and t.grad_fn is None
    assert s.buffers["bn.num_batches_tracked"].dtype == torch.int64
    assert fr.state(nn.ReLU()) == fr.State({}, {})


def test_state_shares_storage_with_the_module() -> None:
    m = nn.Linear(2, 2)
    s = fr.state(m)
    with torch.no_grad():
        m.weight.fill_(3.0)  # the caller's own in-place update is visible: no copy was made
    assert torch.equal(s.params["weight"], torch.full((2, 2), 3.0))


def test_state_tied_parameters_once_under_first_name() -> None:
    m = Tied()
    s = fr.state(m)
    assert list(s.params) == ["emb.weight"]
    assert s.params["emb.weight"].data_ptr() == m.out.weight.data_ptr()


def test_state_rejects_non_modules() -> None:
    with pytest.raises(TypeError, match=r"^fr\.state: module must be an nn\.Module, got dict$"):
        fr.state({})  # type: ignore[arg-type]


# --- fr.apply against the stateful module


@pytest.mark.parametrize("training", [True, False])
def test_apply_equals_module_and_functional_call(training: bool) -> None:
    m = net().train(training)
    s = perturbed(m, seed=3)
    x = x_net()
    guard = snapshot([*module_tensors(m), *s.params.values(), *s.buffers.values(), x])

    out, new = fr.apply(m, s, x, scale=2.0)

    oracle = load(m, s)
    expected = oracle(x, scale=2.0)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    expected_buffers = dict(oracle.named_buffers())
    assert list(new.buffers) == list(expected_buffers)
    for k, v in expected_buffers.items():
        assert torch.equal(new.buffers[k], v), k
    if training:  # the forward really updated them, in the returned state only
        assert (
            int(new.buffers["bn.num_batches_tracked"])
            == int(s.buffers["bn.num_batches_tracked"]) + 1
        )
        assert not torch.equal(new.buffers["bn.running_mean"], s.buffers["bn.running_mean"])
    assert new.params is s.params
    fc_out = torch.func.functional_call(
        load(m, s),
        {**s.params, **{k: v.clone() for k, v in s.buffers.items()}},
        (x,),
        {"scale": 2.0},
    )
    assert torch.equal(out, fc_out)
    assert_unchanged(guard)


def test_apply_chains_buffers_like_repeated_stateful_calls() -> None:
    m = net()
    oracle = copy.deepcopy(m)
    s = fr.state(m)
    for step in range(3):
        x = x_net(step)
        out, s = fr.apply(m, s, x)
        assert torch.equal(out, oracle(x))
    for k, v in oracle.named_buffers():
        assert torch.equal(s.buffers[k], v), k
    assert int(s.buffers["bn.num_batches_tracked"]) == 3
    assert int(m.bn.num_batches_tracked) == 0  # the module never moved


def test_apply_result_is_differentiable_like_the_module() -> None:
    m = net()
    s = perturbed(m, seed=4)
    x = x_net()
    params = {k: v.clone().requires_grad_() for k, v in s.params.items()}
    out, _ = fr.apply(m, fr.State(params, s.buffers), x)
    grads = torch.autograd.grad(out.square().sum(), list(params.values()))
    oracle = load(m, s)
    oracle(x).square().sum().backward()
    for (k, p), g in zip(oracle.named_parameters(), grads):
        torch.testing.assert_close(g, p.grad, msg=k)


def test_missing_names_fall_back_to_the_modules_tensors() -> None:
    m = net()
    x = x_net()
    full = perturbed(m, seed=5)
    partial = fr.State(
        {"head.weight": full.params["head.weight"]}, {"offset": full.buffers["offset"]}
    )
    guard = snapshot(module_tensors(m))
    out, new = fr.apply(m, partial, x)
    oracle = copy.deepcopy(m)
    with torch.no_grad():
        oracle.head.weight.copy_(full.params["head.weight"])
        oracle.offset.copy_(full.buffers["offset"])
    assert torch.equal(out, oracle(x))
    assert set(new.buffers) == {k for k, _ in m.named_buffers()}  # fallbacks come back too
    assert torch.equal(new.buffers["bn.running_mean"], oracle.bn.running_mean)
    assert_unchanged(guard)  # fallback buffers were copied before BatchNorm updated them
    out, new = fr.apply(m, fr.State({}, {}), x)
    assert torch.equal(out, copy.deepcopy(m)(x))


def test_unknown_name_raises_key_error_naming_it() -> None:
    m = net()
    s = fr.state(m)
    with pytest.raises(
        KeyError,
        match=r"fr\.apply: state\.params has 'head\.wieght', which the module does not have",
    ):
        fr.apply(m, fr.State({**s.params, "head.wieght": torch.ones(1)}, s.buffers), x_net())
    with pytest.raises(
        KeyError,
        match=r"fr\.apply: state\.buffers has 'bn\.mean', which the module does not have \(nor \['x'\]\)",
    ):
        fr.apply(m, fr.State({}, {"bn.mean": torch.ones(3), "x": torch.ones(1)}), x_net())


def test_apply_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"^fr\.apply: module must be an nn\.Module, got function$"):
        fr.apply(lambda x: x, fr.State({}, {}), 1)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"^fr\.apply: state must be an fr\.State\(params, buffers\), got dict; make one",
    ):
        fr.apply(nn.ReLU(), {}, torch.ones(1))  # type: ignore[arg-type]


def test_tied_weights_first_name_feeds_both_sites() -> None:
    m = Tied()
    idx = torch.tensor([[0, 3], [4, 1]])
    w = torch.randn(5, 4)
    out, _ = fr.apply(m, fr.State({"emb.weight": w}, {}), idx)
    assert torch.equal(out, (w[idx]) @ w.t())  # both the embedding and the head used w
    # the second name is an alias of the first
    out2, _ = fr.apply(m, fr.State({"out.weight": w}, {}), idx)
    assert torch.equal(out2, out)
    assert torch.equal(out, torch.func.functional_call(m, {"emb.weight": w}, (idx,)))
    with pytest.raises(
        ValueError,
        match=r"^fr\.apply: state\.params gives different tensors for the tied names 'emb\.weight' and 'out\.weight'$",
    ):
        fr.apply(m, fr.State({"emb.weight": w, "out.weight": w.clone()}, {}), idx)
    assert torch.equal(fr.apply(m, fr.State({"emb.weight": w, "out.weight": w}, {}), idx)[0], out)


def test_shared_submodule() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = self.a

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    m = TwoHeads()
    s = perturbed(m, seed=6)
    assert list(s.params) == ["a.weight", "a.bias"]
    x = torch.randn(2, 3)
    assert torch.equal(fr.apply(m, s, x)[0], load(m, s)(x))


def test_honours_training_between_calls() -> None:
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    s = fr.state(m)
    x = torch.ones(64, 4)
    m.eval()
    assert torch.equal(fr.apply(m, s, x)[0], m(x))
    m.train()
    torch.manual_seed(7)
    got = fr.apply(m, s, x)[0]
    torch.manual_seed(7)
    assert torch.equal(got, m(x)) and (got == 0).any()
    m.eval()
    assert torch.equal(fr.apply(m, s, x)[0], m(x))


def test_sees_attribute_changes_after_a_first_call() -> None:
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0))
    s = fr.state(m)
    x = torch.ones(32, 4)
    fr.apply(m, s, x)
    m[1].p = 1.0  # a plain attribute
    assert torch.equal(fr.apply(m, s, x)[0], torch.zeros(32, 4))


def test_sees_submodule_replacement_after_a_first_call() -> None:
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(3, 4)
    fr.apply(m, fr.state(m), x)
    m[1] = nn.Tanh()
    assert torch.equal(fr.apply(m, fr.state(m), x)[0], m(x))
    m.extra = nn.Linear(4, 4)  # a new submodule: its parameters are known at once
    assert "extra.weight" in fr.state(m).params
    fr.apply(m, fr.State({"extra.weight": torch.ones(4, 4)}, {}), x)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.__delitem__(1),
        lambda m: m.insert(1, nn.Tanh()),
        lambda m: m.pop(2),
        lambda m: m.append(nn.Sigmoid()),
    ],
    ids=["del", "insert", "pop", "append"],
)
def test_sees_children_removed_or_inserted_without_registration(
    change: Callable[[nn.Sequential], Any],
) -> None:
    # regression: del / insert / pop write _modules directly and fire no registration
    # hook, so apply kept running the cached skeleton of the old structure
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    x = torch.randn(3, 4)
    fr.apply(m, fr.state(m), x)
    change(m)
    assert torch.equal(fr.apply(m, fr.state(m), x)[0], m(x))


def test_sees_deleted_attributes_and_forgets_forward_side_effects() -> None:
    # regression: the skeleton's attributes were refreshed with dict.update, which
    # never removes a key: a deleted attribute, or one set by a forward, lingered
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.scale = 2.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls = getattr(self, "calls", 0) + 1  # a side effect on self
            return self.lin(x) * getattr(self, "scale", 1.0) * self.calls

    m = Counting()
    s, x = fr.state(m), torch.randn(3, 2)
    first = fr.apply(m, s, x)[0]
    assert torch.equal(fr.apply(m, s, x)[0], first)  # each call sees the module as it is
    assert not hasattr(m, "calls")  # and the module is untouched
    del m.scale
    assert torch.equal(fr.apply(m, s, x)[0], first / 2)


def test_forward_that_reassigns_a_buffer() -> None:
    class Ema(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("avg", torch.zeros(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.avg = 0.5 * self.avg + 0.5 * x.mean(0)  # not in place: a new tensor
            return x - self.avg

    m = Ema()
    oracle = copy.deepcopy(m)
    s = fr.state(m)
    for i in range(3):
        x = torch.randn(4, 3) + i
        out, s = fr.apply(m, s, x)
        assert torch.equal(out, oracle(x))
        assert torch.equal(s.buffers["avg"], oracle.avg)
    assert torch.equal(m.avg, torch.zeros(3))


def test_kwargs_and_positional_args() -> None:
    class Mix(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(
            self, a: torch.Tensor, b: torch.Tensor, *, gate: torch.Tensor | None = None
        ) -> Any:
            y = self.lin(a) + b
            return {"y": y if gate is None else y * gate, "n": 3}

    m = Mix()
    s = perturbed(m, seed=8)
    a, b, gate = torch.randn(2, 3), torch.randn(2, 3), torch.rand(2, 3)
    out, _ = fr.apply(m, s, a, b, gate=gate)
    assert out["n"] == 3
    assert torch.equal(out["y"], load(m, s)(a, b, gate=gate)["y"])


def test_hooks_on_the_module_fire() -> None:
    m = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    s = perturbed(m, seed=9)
    seen: list[str] = []
    m[0].register_forward_pre_hook(lambda mod, args: seen.append("pre") or (args[0] * 2,))
    x = torch.randn(2, 3)
    fr.apply(m, s, x)
    assert seen == ["pre"]
    # a hook registered after the first call fires too, and sees the bound state
    weights: list[torch.Tensor] = []
    m[0].register_forward_hook(lambda mod, args, out: weights.append(mod.weight) or out + 1)
    out2, _ = fr.apply(m, s, x)
    assert seen == ["pre", "pre"]
    assert len(weights) == 1 and weights[0] is s.params["0.weight"]
    assert torch.equal(out2, load(m, s)(x))  # the copy carries the same hooks


# --- concurrency: one module, many threads, different states


class Gate(nn.Module):
    """Every forward waits for all N callers twice: a lock that serialised apply would time out.

    All N calls are bound and inside the forward before any reads ``self.w``, and
    all have read it before any returns.
    """

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))
        self.bound = threading.Barrier(n, timeout=20)
        self.read = threading.Barrier(n, timeout=20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.bound.wait()
        w = self.w
        self.read.wait()
        return x * w


def run_threads(n: int, call: Callable[[int], Any]) -> list[Any]:
    results: list[Any] = [None] * n

    def worker(i: int) -> None:
        try:
            results[i] = call(i)
        except BaseException as err:  # collected and raised in the caller
            results[i] = err

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return results


def test_concurrent_calls_overlap_and_each_sees_its_own_state() -> None:
    n = 8
    m = Gate(n)
    x = torch.ones(3)
    results = run_threads(
        n, lambda i: fr.apply(m, fr.State({"w": torch.tensor(float(i))}, {}), x)[0]
    )
    for i, r in enumerate(results):
        if isinstance(r, BaseException):
            raise r  # BrokenBarrierError: the calls did not run at the same time
        assert torch.equal(r, torch.full((3,), float(i)))
    assert torch.equal(m.w, torch.zeros(()))


def test_functional_call_alone_is_not_thread_safe() -> None:
    # Why apply does not simply call functional_call: it rebinds the module's own
    # attributes, so overlapping calls read each other's tensors (and it can leave
    # the module holding a caller's tensor afterwards).
    n = 8
    m = Gate(n)
    x = torch.ones(3)
    results = run_threads(
        n, lambda i: torch.func.functional_call(m, {"w": torch.tensor(float(i))}, (x,))
    )
    wrong = [
        i
        for i, r in enumerate(results)
        if isinstance(r, BaseException) or not torch.equal(r, torch.full((3,), float(i)))
    ]
    # every call reads self.w while all n are bound and none has unbound: they all
    # read the tensor bound last, so at most one of them can be right
    assert len(wrong) >= n - 1


def hammer(
    call: Callable[[nn.Module, fr.State, torch.Tensor], tuple[torch.Tensor, Any]],
) -> tuple[int, list[tuple[torch.Tensor, int, torch.Tensor]]]:
    """8 threads, 25 calls each, on ONE module with different states; count wrong results.

    ``call(module, state, x)`` returns ``(output, buffers or None)``; each result is
    checked against the stateful module holding that thread's state. Also returns
    a snapshot, taken before the calls, of the module's tensors and every state.
    """
    n, iters = 8, 25
    m = net()
    states = [perturbed(m, seed=100 + i) for i in range(n)]
    xs = [x_net(200 + i) for i in range(n)]
    expected = []
    for s, x in zip(states, xs):
        oracle = load(m, s)
        expected.append((oracle(x), dict(oracle.named_buffers())))
    guard = snapshot([*module_tensors(m), *(t for s in states for t in optree.tree_leaves(s))])
    start = threading.Barrier(n, timeout=20)

    def worker(i: int) -> int:
        start.wait()
        bad = 0
        for _ in range(iters):
            try:
                out, bufs = call(m, states[i], xs[i])
            except Exception:
                bad += 1
                continue
            exp_out, exp_bufs = expected[i]
            bad += not torch.equal(out, exp_out)
            if bufs is not None:
                bad += any(not torch.equal(bufs[k], v) for k, v in exp_bufs.items())
        return bad

    results = run_threads(n, worker)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return sum(results), guard


def test_concurrent_calls_many_iterations_with_batchnorm() -> None:
    def call(m: nn.Module, s: fr.State, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out, new = fr.apply(m, s, x)
        return out, new.buffers

    bad, guard = hammer(call)
    assert bad == 0
    assert_unchanged(guard)


def test_the_same_check_catches_functional_call() -> None:
    # The check above is strong enough to see the race apply avoids: run through
    # torch.func.functional_call, about 190 of its 200 results are wrong here
    # (measured over 20 runs, never fewer than 170).
    def call(m: nn.Module, s: fr.State, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        bufs = {k: v.clone() for k, v in s.buffers.items()}
        return torch.func.functional_call(m, {**s.params, **bufs}, (x,)), None

    assert hammer(call)[0] > 0


def test_tensorless_modules_run_as_themselves() -> None:
    # modules with no tensor below them need no skeleton copy: the root itself here
    x = torch.randn(3, 4)
    relu = nn.ReLU()
    out, new = fr.apply(relu, fr.State({}, {}), x)
    assert torch.equal(out, x.relu()) and new == fr.State({}, {})
    seq = nn.Sequential(nn.Sequential(nn.Tanh(), nn.Identity()), nn.Sequential(nn.Linear(4, 4)))
    s = perturbed(seq, seed=11)
    assert torch.equal(fr.apply(seq, s, x)[0], load(seq, s)(x))


def test_forward_arguments_named_module_or_state_pass_through() -> None:
    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, x: torch.Tensor, module: float = 1.0, state: float = 1.0) -> torch.Tensor:
            return x * self.w * module * state

    m = Named()
    s = fr.State({"w": torch.full((2,), 2.0)}, {})
    out, _ = fr.apply(m, s, torch.ones(2), module=3.0, state=5.0)
    assert torch.equal(out, torch.full((2,), 30.0))


def test_no_caller_tensor_outlives_the_call() -> None:
    # the pooled skeleton is unbound after each call: it keeps the module's own tensors only
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2, bias=False))
    s = fr.state(model)
    params = {k: v.clone() for k, v in s.params.items()}
    buffers = {k: v.clone() for k, v in s.buffers.items()}
    refs = [weakref.ref(t) for t in (*params.values(), *buffers.values())]
    out, new = fr.apply(model, fr.State(params, buffers), torch.randn(4, 3))
    del params, buffers, out, new
    gc.collect()
    assert all(r() is None for r in refs)
    out, _ = fr.apply(model, s, torch.randn(4, 3))  # and the module is whole again
    assert model[2].bias is None and out.shape == (4, 2)
