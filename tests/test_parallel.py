"""fr.scatter, fr.gather, fr.parallel_apply, fr.data_parallel, fr.all_reduce, fr.data_parallel_grad.

The oracle is the stateful design: per-replica deep copies of the module
driven through autograd as ``nn.DataParallel`` drives its replicas
(``tests/_oracles.py``), ``torch.func.grad`` / ``loss.backward()`` on the full
batch for the DDP-style gradient, and ``nn.DataParallel`` itself where CUDA is
available. Every call is also checked to leave its inputs unchanged.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import importlib.util
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel._functions import Gather, Scatter
from torch.nn.parallel.scatter_gather import gather, scatter

import freplicate as fr
from freplicate import _tree
from freplicate.testing import check_against_stateful
from freplicate.testing._strategies import CONTAINER_KINDS, Items, Output, Record, contain

_spec = importlib.util.spec_from_file_location("_oracles", Path(__file__).with_name("_oracles.py"))
assert _spec is not None and _spec.loader is not None
oracles = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("_oracles", oracles)
_spec.loader.exec_module(oracles)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
DEVICE_LISTS = [["cpu"], ["cpu", "cpu"], ["cpu", "cpu", "cpu"]]


# --------------------------------------------------------------------------- helpers


def snapshot(*trees: Any) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    leaves = [x for x in optree.tree_leaves(trees) if isinstance(x, torch.Tensor)]
    return [(t, t._version, t.detach().clone()) for t in leaves]


def assert_unchanged(snap: list[tuple[torch.Tensor, int, torch.Tensor]]) -> None:
    for t, version, values in snap:
        assert t._version == version
        torch.testing.assert_close(t.detach(), values, rtol=0, atol=0, equal_nan=True)


def assert_trees_close(actual: Any, expected: Any, **tol: Any) -> None:
    a_leaves, a_spec = optree.tree_flatten(actual)
    e_leaves, e_spec = optree.tree_flatten(expected)
    assert a_spec == e_spec, (a_spec, e_spec)
    for a, e in zip(a_leaves, e_leaves):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(a, e, **tol)
        else:
            assert a == e


class Pair(NamedTuple):
    left: Any
    right: Any


# --------------------------------------------------------------------------- scatter


def test_scatter_cuts_every_leaf_as_torch_chunk_and_shares_the_rest() -> None:
    x, y = torch.randn(7, 3), torch.randn(2, 7)
    tag = object()
    tree = {"a": [x, None, "s"], "b": Pair(y, tag), "c": (3,)}
    snap = snapshot(tree)
    shards = fr.scatter(tree, ["cpu"] * 3, dim=-1)
    assert_unchanged(snap)
    # dim=-1 cuts x (7, 3) along its columns and y (2, 7) along its 7
    for i, shard in enumerate(shards):
        torch.testing.assert_close(shard["a"][0], torch.chunk(x, 3, -1)[i])
        torch.testing.assert_close(shard["b"].left, y.chunk(3, -1)[i])
        assert shard["b"].right is tag and shard["a"][2] == "s" and shard["a"][1] is None
        assert isinstance(shard["b"], Pair) and shard["c"] == (3,)


def test_scatter_matches_the_reference_recursion() -> None:
    tree = (torch.randn(8, 2), {"k": [torch.randn(8), 5]}, Pair(torch.randn(8, 1), "t"))
    expected = oracles.reference_scatter(tree, 3)
    got = fr.scatter(tree, ["cpu"] * 3)
    assert len(got) == len(expected) == 3
    for g, e in zip(got, expected):
        assert_trees_close(g, tuple(e), rtol=0, atol=0)


@pytest.mark.parametrize(("batch", "n", "shards"), [(3, 4, 3), (5, 4, 3), (8, 4, 4), (1, 2, 1)])
def test_scatter_gives_fewer_shards_when_torch_chunk_does(batch: int, n: int, shards: int) -> None:
    x = torch.arange(float(batch))
    out = fr.scatter({"x": x}, ["cpu"] * n)
    assert len(out) == shards == len(torch.chunk(x, n))
    torch.testing.assert_close(torch.cat([s["x"] for s in out]), x)


def test_scatter_follows_the_leaf_with_fewest_chunks() -> None:
    # as nn.parallel.scatter (its zip stops at the shortest)
    out = fr.scatter((torch.ones(8), torch.ones(2)), ["cpu"] * 4)
    assert len(out) == 2 == len(oracles.reference_scatter((torch.ones(8), torch.ones(2)), 4))
    assert [s[0].shape[0] for s in out] == [2, 2]


def test_scatter_without_tensors_gives_one_shard_per_device() -> None:
    assert fr.scatter({"a": 1, "b": "x"}, ["cpu", "cpu"]) == [{"a": 1, "b": "x"}] * 2


def test_scatter_keeps_tied_leaves_tied() -> None:
    t = torch.randn(4, 2)
    shards = fr.scatter([t, t], ["cpu", "meta"])
    assert shards[0][0] is shards[0][1] and shards[1][0] is shards[1][1]
    assert shards[1][0].device.type == "meta"


def test_scatter_moves_chunk_i_to_device_i() -> None:
    shards = fr.scatter({"x": torch.randn(4, 2), "i": torch.arange(4)}, ["cpu", "meta"])
    assert [s["x"].device.type for s in shards] == ["cpu", "meta"]
    assert shards[1]["i"].dtype == torch.int64 and shards[1]["i"].shape == (2,)


def test_scatter_is_differentiable() -> None:
    x = torch.randn(6, 3, requires_grad=True)
    w = torch.arange(3.0) + 1
    shards = fr.scatter(x, ["cpu"] * 3)
    sum(s.sum() * w[i] for i, s in enumerate(shards)).backward()  # type: ignore[union-attr]
    torch.testing.assert_close(x.grad, w.repeat_interleave(2)[:, None].expand(6, 3))

    def f(x: torch.Tensor) -> torch.Tensor:
        return sum((s**2).sum() * (i + 1) for i, s in enumerate(fr.scatter(x, ["cpu"] * 2)))  # type: ignore[return-value]

    g = torch.func.grad(f)(x.detach())
    torch.testing.assert_close(g, 2 * x.detach() * torch.tensor([1.0, 1, 1, 2, 2, 2])[:, None])


def test_scatter_rejects_bad_input() -> None:
    x = torch.randn(4, 2)
    snap = snapshot(x)
    with pytest.raises(
        ValueError,
        match=r"fr\.scatter: dim=2 is out of range for the tensor at \['b'\]\[0\] of shape \(4, 2\)",
    ):
        fr.scatter({"b": [x]}, ["cpu"], dim=2)
    with pytest.raises(ValueError, match=r"fr\.scatter: the tensor at \['s'\] is 0-dim"):
        fr.scatter({"x": x, "s": torch.tensor(1.0)}, ["cpu"])
    with pytest.raises(ValueError, match=r"fr\.scatter: devices is empty"):
        fr.scatter(x, [])
    with pytest.raises(ValueError, match=r"fr\.scatter: devices\[1\] is not a device"):
        fr.scatter(x, ["cpu", "tpu:0"])
    assert_unchanged(snap)


# --------------------------------------------------------------------------- gather


@dataclasses.dataclass
class Info:
    n: int


def test_gather_concatenates_and_handles_what_dataparallel_breaks_on() -> None:
    trees = [
        {
            "y": torch.randn(2, 3),
            "s": torch.tensor(1.0),
            "name": "a",
            "k": 4,
            "d": Info(1),
            "z": None,
        },
        {
            "y": torch.randn(1, 3),
            "s": torch.tensor(2.0),
            "name": "b",
            "k": 4,
            "d": Info(1),
            "z": None,
        },
    ]
    snap = snapshot(trees)
    out = fr.gather(trees, "cpu")
    assert_unchanged(snap)
    torch.testing.assert_close(out["y"], torch.cat([trees[0]["y"], trees[1]["y"]]))
    torch.testing.assert_close(out["s"], torch.tensor([1.0, 2.0]))
    assert out["name"] == ("a", "b") and out["k"] == 4 and out["d"] == Info(1) and out["z"] is None


def test_gather_matches_the_reference_on_tensor_trees() -> None:
    trees = [Pair([torch.randn(3, i + 1)], {"l": torch.tensor(float(i))}) for i in range(3)]
    assert_trees_close(fr.gather(trees, "cpu", dim=1), oracles.reference_gather(trees, 1))
    assert_trees_close(fr.gather(trees, "cpu", dim=-1), oracles.reference_gather(trees, 1))


def test_gather_undoes_scatter_and_moves_to_the_device() -> None:
    x = {"a": torch.randn(9, 2), "b": [torch.randint(0, 5, (9,))]}
    assert_trees_close(fr.gather(fr.scatter(x, ["cpu"] * 4), "cpu"), x, rtol=0, atol=0)
    on_meta = fr.gather(fr.scatter(x, ["cpu"] * 2), "meta")
    assert on_meta["a"].device.type == "meta" and on_meta["a"].shape == (9, 2)


def test_gather_is_differentiable() -> None:
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(4, 3, requires_grad=True)
    s = torch.tensor(2.0, requires_grad=True)
    out = fr.gather([{"y": a, "s": s}, {"y": b, "s": s * 3}], "cpu")
    w = torch.arange(6.0)[:, None]
    ((out["y"] * w).sum() + out["s"].sum()).backward()
    torch.testing.assert_close(a.grad, w[:2].expand(2, 3))
    torch.testing.assert_close(b.grad, w[2:].expand(4, 3))
    torch.testing.assert_close(s.grad, torch.tensor(4.0))

    g = torch.func.grad(lambda a: (fr.gather([a, a * 2], "cpu") ** 2).sum())(a.detach())
    torch.testing.assert_close(g, 10 * a.detach())


def test_gather_rejects_bad_input() -> None:
    t = torch.ones(2)
    with pytest.raises(
        ValueError,
        match=r"fr\.gather: trees differ at \['b'\]: list of 2 in tree 0, list of 1 in tree 1",
    ):
        fr.gather([{"a": t, "b": [t, t]}, {"a": t, "b": [t]}], "cpu")
    with pytest.raises(
        ValueError,
        match=r"fr\.gather: trees differ at \['a'\]: a tensor of shape \(2,\) and dtype torch\.float32 in tree 0, an int \(3\) in tree 1",
    ):
        fr.gather([{"a": t}, {"a": 3}], "cpu")
    with pytest.raises(
        ValueError,
        match=r"fr\.gather: trees differ at \[0\]: shape \(\) in tree 0, \(2,\) in tree 1",
    ):
        fr.gather([(torch.tensor(1.0),), (t,)], "cpu")
    with pytest.raises(
        ValueError,
        match=r"fr\.gather: dim=1 is out of range for the tensor at <root> of shape \(2,\)",
    ):
        fr.gather([t, t], "cpu", dim=1)
    with pytest.raises(
        ValueError,
        match=r"fr\.gather: cannot concatenate the tensors at \['x'\] along dim 0: shapes \(2, 1\), \(2, 3\)",
    ):
        fr.gather([{"x": torch.ones(2, 1)}, {"x": torch.ones(2, 3)}], "cpu")
    with pytest.raises(ValueError, match=r"fr\.gather: trees is empty"):
        fr.gather([], "cpu")
    with pytest.raises(ValueError, match=r"fr\.gather: device is not a device"):
        fr.gather([t], "gpu")


# --------------------------------------------------------------------------- containers optree keeps whole


@contextlib.contextmanager
def nn_parallel_on_cpu() -> Iterator[None]:
    """``nn.parallel.scatter`` and ``gather``'s own code, their CUDA-only copies done on CPU.

    How each container is taken apart and built again is PyTorch's; only
    ``Scatter`` and ``Gather``, which refuse CPU tensors, become
    ``torch.chunk`` and ``torch.cat`` (0-dim parts as rows, as ``Gather``).
    """

    def chunk(devices: Any, streams: Any, dim: int, t: torch.Tensor) -> Any:
        return t.chunk(len(devices), dim)

    def cat(device: Any, dim: int, *parts: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.view(1) if p.dim() == 0 else p for p in parts], dim)

    with mock.patch.object(Scatter, "apply", chunk), mock.patch.object(Gather, "apply", cat):
        yield


def assert_same_containers(actual: Any, expected: Any) -> None:
    """Equal trees, looking inside the containers optree keeps whole (their types compared too)."""
    a_leaves, a_spec = _tree.flatten_containers(actual)
    e_leaves, e_spec = _tree.flatten_containers(expected)
    assert a_spec == e_spec, (a_spec, e_spec)
    assert_trees_close(a_leaves, e_leaves, rtol=0, atol=0)


@pytest.mark.parametrize("kind", CONTAINER_KINDS)
def test_scatter_takes_every_container_apart_as_nn_parallel_scatter(kind: str) -> None:
    x, y = torch.randn(5, 2), torch.randn(5)
    tree = (contain(kind, x, "tag"), {"k": contain(kind, y, 2)})
    snap = snapshot(tree, x, y)
    got = fr.scatter(tree, ["cpu"] * 3)
    assert_unchanged(snap)
    with nn_parallel_on_cpu():
        expected = scatter(tree, ["cpu"] * 3)
    assert len(got) == len(expected) == 3
    for mine, theirs in zip(got, expected):
        if kind == "list_subclass":
            # nn.parallel.scatter makes plain lists of it; fr.scatter keeps the type
            assert type(theirs[0]) is list and type(mine[0]) is Items
            theirs = (Items(theirs[0]), {"k": Items(theirs[1]["k"])})
        if kind == "dataclass":  # shared whole by both, not looked into
            assert mine[0] is theirs[0] is tree[0]
        assert_same_containers(mine, tuple(theirs))


@pytest.mark.parametrize("kind", CONTAINER_KINDS)
def test_gather_joins_every_container_as_nn_parallel_gather(kind: str) -> None:
    outs = [contain(kind, torch.randn(i + 1, 2), torch.tensor(float(i))) for i in range(3)]
    snap = snapshot(*(_tree.flatten_containers(o)[0] for o in outs))
    got = fr.gather(outs, "cpu")
    assert_unchanged(snap)
    if kind == "dataclass":  # nn.parallel.gather raises; fr.gather joins it field by field
        with nn_parallel_on_cpu(), pytest.raises(TypeError, match="not iterable"):
            gather(outs, "cpu")
        first, second = zip(*((o.first, o.second) for o in outs))
        expected = Record(torch.cat(first), torch.stack(second))
    else:
        with nn_parallel_on_cpu():
            expected = gather(outs, "cpu")
    assert type(got) is type(outs[0])
    assert_same_containers(got, expected)


def test_a_model_output_keeps_its_keys_attributes_and_tree_0s_order() -> None:
    a = Output(loss=torch.tensor(1.0), logits=torch.ones(2, 3), hidden="h")
    b = Output(loss=torch.tensor(3.0), logits=torch.zeros(1, 3), hidden="h")
    out = fr.gather([a, b], "cpu")
    assert list(out) == ["loss", "logits", "hidden"] and out.hidden == "h"
    assert out.logits is out["logits"] and out.logits.shape == (3, 3)
    torch.testing.assert_close(out.loss, torch.tensor([1.0, 3.0]))

    class Keyed(dict):  # a dict subclass whose replicas made their keys in other orders
        pass

    out = fr.gather(
        [Keyed(b=torch.ones(1), a=torch.ones(1)), Keyed(a=torch.zeros(1), b=torch.ones(1))], "cpu"
    )
    assert type(out) is Keyed and list(out) == ["b", "a"]
    torch.testing.assert_close(out["a"], torch.tensor([1.0, 0.0]))


def test_shapes_and_defaultdicts_where_nn_parallel_breaks() -> None:
    # a torch.Size is a value, not a container: shared by scatter, merged or kept per tree by gather
    trees = [
        {"y": torch.ones(2, 3), "s": torch.Size([2, 3])},
        {"y": torch.ones(1, 3), "s": torch.Size([1, 3])},
    ]
    assert fr.gather(trees, "cpu")["s"] == (torch.Size([2, 3]), torch.Size([1, 3]))
    with nn_parallel_on_cpu(), pytest.raises(TypeError):
        gather(trees, "cpu")
    shards = fr.scatter(trees[0], ["cpu", "cpu"])
    assert all(s["s"] is trees[0]["s"] for s in shards)
    # a defaultdict keeps its type and factory, where nn.parallel calls defaultdict(pairs)
    d = collections.defaultdict(list, y=torch.ones(4))
    shards = fr.scatter(d, ["cpu", "cpu"])
    out = fr.gather(shards, "cpu")
    assert type(out) is collections.defaultdict and out.default_factory is list
    torch.testing.assert_close(out["y"], d["y"])
    with nn_parallel_on_cpu():
        for fails in (lambda: scatter(d, ["cpu", "cpu"]), lambda: gather(shards, "cpu")):
            with pytest.raises(TypeError, match="must be callable"):
                fails()


class Strict(dict):  # type: ignore[type-arg]
    """A dict subclass whose constructor takes keywords only: neither nn.parallel nor fr can build one."""

    def __init__(self, **items: Any) -> None:
        super().__init__(**items)


def test_containers_that_cannot_be_rebuilt_or_differ_are_named() -> None:
    t = torch.ones(2)
    refused = (
        r"cannot rebuild the Strict at {} with new values: Strict\(pairs\) raised TypeError: .*; "
        r"give it a constructor that takes \(key, value\) pairs"
    )
    with pytest.raises(TypeError, match=r"fr\.gather: " + refused.format(r"\['o'\]")) as err:
        fr.gather([{"o": Strict(a=t)}, {"o": Strict(a=t)}], "cpu")
    assert isinstance(err.value.__cause__, TypeError)
    with pytest.raises(TypeError, match=r"fr\.scatter: " + refused.format(r"\[1\]")):
        fr.scatter((t, Strict(a=t)), ["cpu", "cpu"])
    lin = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"fr\.data_parallel: " + refused.format(r"kwargs\['x'\]")):
        fr.data_parallel(lin, fr.state(lin), devices=["cpu", "cpu"], x=Strict(a=t))
    step = fr.data_parallel_grad(lambda p, b: (b["a"] * p["w"]).sum(), ["cpu", "cpu"])
    with pytest.raises(
        TypeError, match=r"fr\.data_parallel_grad: " + refused.format(r"batch\[0\]")
    ):
        step({"w": torch.ones(1)}, Strict(a=t))
    with pytest.raises(
        ValueError,
        match=r"fr\.gather: trees differ at \['o'\]: Output with keys \('logits',\) in tree 0, "
        r"Record with fields \('first', 'second'\) in tree 1",
    ):
        fr.gather([{"o": Output(logits=t)}, {"o": Record(t, t)}], "cpu")
    with pytest.raises(
        ValueError,
        match=r"fr\.gather: trees differ at \[0\]: Output with keys \('logits',\) in tree 0, "
        r"Output with keys \('loss', 'logits'\) in tree 1",
    ):
        fr.gather([[Output(logits=t)], [Output(loss=t, logits=t)]], "cpu")


class Classifier(nn.Module):
    """A model as ``transformers`` writes one: keyword inputs, a ``ModelOutput`` out."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Output:
        hidden = self.body(x)
        logits = self.head(hidden)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return Output(loss=loss, logits=logits, hidden=(hidden,))


@pytest.mark.parametrize("devices", DEVICE_LISTS)
def test_data_parallel_of_a_model_output_model_equals_the_stateful_replicas(
    devices: list[str],
) -> None:
    torch.manual_seed(0)
    model = Classifier()
    x, labels = torch.randn(8, 4), torch.randint(0, 3, (8,))  # shards of 2 rows or more: BatchNorm
    check_against_stateful(model, {"x": x, "labels": labels}, devices)
    check_against_stateful(model, (x,), devices)
    out, _ = fr.data_parallel(model, fr.state(model), x=x, labels=labels, devices=devices)
    assert type(out) is Output and list(out) == ["loss", "logits", "hidden"]
    assert out.logits.shape == (8, 3) and out.loss.shape == (
        (len(devices),) if len(devices) > 1 else ()
    )


def test_data_parallel_on_one_device_moves_a_model_output_to_the_output_device() -> None:
    torch.manual_seed(0)
    model = Classifier()
    out, _ = fr.data_parallel(
        model, fr.state(model), torch.randn(3, 4), devices=["cpu"], output_device="meta"
    )
    assert type(out) is Output and out.logits.device.type == "meta"
    assert out.hidden[0].device.type == "meta" and out.loss is None


@pytest.mark.parametrize("how", ["gather", "first", "mean"])
def test_data_parallel_grad_combines_aux_in_containers(how: str) -> None:
    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
        y = x @ p["w"]
        return y.mean(), Output(loss=y.mean(), logits=y, hidden=Record(y.sum(), "r"))

    x = torch.arange(8.0).reshape(4, 2)
    step = fr.data_parallel_grad(loss_fn, ["cpu", "cpu"], has_aux=True, aux=how)  # type: ignore[arg-type]
    _, (_, aux) = step({"w": torch.ones(2)}, x)
    per = [loss_fn({"w": torch.ones(2)}, shard)[1] for shard in x.chunk(2)]
    assert type(aux) is Output and type(aux.hidden) is Record and aux.hidden.second == "r"
    if how == "gather":
        torch.testing.assert_close(aux.logits, x.sum(1))
        torch.testing.assert_close(aux.hidden.first, torch.stack([o.hidden.first for o in per]))
    elif how == "first":
        assert_same_containers(aux, per[0])
    else:
        torch.testing.assert_close(aux.loss, (per[0].loss + per[1].loss) / 2)
        torch.testing.assert_close(
            aux.hidden.first, (per[0].hidden.first + per[1].hidden.first) / 2
        )


def test_parallel_apply_finds_the_device_inside_a_dict_subclass() -> None:
    def second_fails(replica: int, out: Output) -> Output:
        if replica:
            raise ValueError("no")
        return out

    inputs = [(Output(logits=torch.ones(1)),), (Output(logits=torch.ones(1)),)]
    with pytest.raises(ValueError, match=r"fr\.parallel_apply: replica 1 on cpu raised"):
        fr.parallel_apply(second_fails, [0, 1], inputs)


def test_data_parallel_binds_none_in_the_state_on_every_replica() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    params, buffers = fr.state(model)
    state = fr.State(
        {**params, "0.bias": None}, {**buffers, "1.running_mean": None, "1.running_var": None}
    )
    x = torch.randn(6, 3)
    for how in ("first", "mean"):
        out, new = fr.data_parallel(model, state, x, devices=["cpu", "cpu"], buffers=how)  # type: ignore[arg-type]
        copies = [copy.deepcopy(model) for _ in range(2)]
        for c in copies:
            c[0].bias = None
            c[1].running_mean = c[1].running_var = None
        torch.testing.assert_close(out, torch.cat([c(s) for c, s in zip(copies, x.chunk(2))]))
        assert new.buffers["1.running_mean"] is None and new.buffers["1.running_var"] is None
        assert int(new.buffers["1.num_batches_tracked"]) == 1
    assert model[0].bias is not None


# --------------------------------------------------------------------------- parallel_apply


def test_parallel_apply_runs_every_replica_at_once_in_threads_that_end() -> None:
    before = threading.active_count()
    barrier = threading.Barrier(3, timeout=20)  # breaks (and fails the test) if run one at a time
    idents: list[int] = []

    def fn(w: torch.Tensor, x: torch.Tensor, *, k: int) -> torch.Tensor:
        idents.append(threading.get_ident())
        barrier.wait()
        return w * x + k

    ws = [torch.tensor(float(i)) for i in range(3)]
    xs = [(torch.tensor(10.0),), [torch.tensor(20.0)], torch.tensor(30.0)]
    snap = snapshot(ws, xs)
    out = fr.parallel_apply(fn, ws, xs, devices=["cpu"] * 3, kwargs=[{"k": 1}, {"k": 2}, {"k": 3}])
    assert out == [torch.tensor(1.0), torch.tensor(22.0), torch.tensor(63.0)]
    assert len(set(idents)) == 3 and threading.get_ident() in idents
    assert threading.active_count() == before
    assert_unchanged(snap)


def test_parallel_apply_with_one_replica_runs_inline() -> None:
    out = fr.parallel_apply(lambda r, x: (r, threading.get_ident()), ["r"], [(1,)])
    assert out == [("r", threading.get_ident())]


@pytest.mark.parametrize("mode", ["enabled", "no_grad", "inference", "autocast"])
def test_parallel_apply_runs_in_the_callers_modes(mode: str) -> None:
    def fn(r: Any) -> tuple[bool, bool, bool]:
        return (
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cpu"),
        )

    ctx = {
        "enabled": torch.enable_grad(),
        "no_grad": torch.no_grad(),
        "inference": torch.inference_mode(),
        "autocast": torch.autocast("cpu", dtype=torch.bfloat16),
    }[mode]
    with ctx:
        expected = fn(None)
        out = fr.parallel_apply(fn, [0, 1, 2], [(), (), ()])
    assert out == [expected] * 3
    assert (
        expected
        == {
            "enabled": (True, False, False),
            "no_grad": (False, False, False),
            "inference": (False, True, False),
            "autocast": (True, False, True),
        }[mode]
    )


def test_parallel_apply_autocast_really_applies_in_workers() -> None:
    w = torch.randn(3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fr.parallel_apply(lambda w, x: w @ x, [w, w], [(w,), (w,)])
    assert [o.dtype for o in out] == [torch.bfloat16] * 2


def _openmp_threads() -> Any:
    """libgomp's own per-thread count (``torch.get_num_threads`` reports the global setting)."""
    import ctypes
    import os

    path = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if not path.exists() or (os.cpu_count() or 1) < 2:
        pytest.skip("needs torch's libgomp and 2 cores to tell the thread counts apart")
    return ctypes.CDLL(str(path)).omp_get_max_threads


def test_parallel_apply_workers_compute_with_the_callers_intra_op_thread_count() -> None:
    # OpenMP keeps the count per thread: a new thread used every core whatever
    # torch.set_num_threads said, and two CPU replicas on 2 cores ran 3 compute
    # threads (a data_parallel_grad step of small_mlp took 7.8 ms, 1.5 ms now)
    omp = _openmp_threads()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seen = fr.parallel_apply(lambda r: omp(), [0, 1, 2], [(), (), ()], devices=["cpu"] * 3)
        in_replicas = []

        def loss(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            in_replicas.append(omp())
            return (p * x.sum()).sum()

        grads, _ = fr.data_parallel_grad(loss, ["cpu", "cpu"])(torch.ones(2), torch.ones(4))
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 1, 1]
    assert in_replicas == [1, 1]
    assert torch.equal(grads, torch.full((2,), 2.0))  # the mean of the two shards' sums


def test_parallel_apply_reraises_with_index_and_device() -> None:
    before = threading.active_count()

    def fn(r: int) -> int:
        if r == 1:
            raise ValueError("boom")
        return r

    with pytest.raises(
        ValueError, match=r"^fr\.parallel_apply: replica 1 on cpu raised ValueError: boom$"
    ) as info:
        fr.parallel_apply(fn, [0, 1, 2], [(), (), ()], devices=["cpu"] * 3)
    assert isinstance(info.value.__cause__, ValueError) and str(info.value.__cause__) == "boom"
    assert threading.active_count() == before

    with pytest.raises(KeyError, match=r"replica 0 \(device unknown\) raised KeyError: 'k'"):
        fr.parallel_apply(lambda d: d["k"], [{}, {}], [(), ()])


class Picky(Exception):
    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code, detail)


def test_parallel_apply_falls_back_when_the_type_needs_more_than_a_message() -> None:
    def fn(r: int) -> None:
        raise Picky(7, "bad")

    with pytest.raises(RuntimeError, match=r"replica 0 on cpu raised Picky: \(7, 'bad'\)") as info:
        fr.parallel_apply(fn, [0, 1], [(), ()], devices=["cpu", "cpu"])
    assert isinstance(info.value.__cause__, Picky)


def test_parallel_apply_under_torch_func_grad_is_correct() -> None:
    # torch.func's state is thread-local: threads would silently see no transform
    x1, x2 = torch.randn(3), torch.randn(3)

    def f(w: torch.Tensor) -> torch.Tensor:
        outs = fr.parallel_apply(lambda r, x: (r * x).sum(), [w, w], [(x1,), (x2,)])
        return outs[0] + outs[1]

    torch.testing.assert_close(torch.func.grad(f)(torch.ones(3)), x1 + x2)


def test_parallel_apply_rejects_lengths_that_disagree() -> None:
    fn = lambda r, *a: r  # noqa: E731
    with pytest.raises(
        ValueError, match=r"fr\.parallel_apply: replicas has 2 entries but inputs has 3"
    ):
        fr.parallel_apply(fn, [0, 1], [(), (), ()])
    with pytest.raises(
        ValueError, match=r"fr\.parallel_apply: replicas has 2 entries but devices has 1"
    ):
        fr.parallel_apply(fn, [0, 1], [(), ()], devices=["cpu"])
    with pytest.raises(
        ValueError, match=r"fr\.parallel_apply: replicas has 2 entries but kwargs has 1"
    ):
        fr.parallel_apply(fn, [0, 1], [(), ()], kwargs=[{}])
    with pytest.raises(ValueError, match=r"fr\.parallel_apply: replicas is empty"):
        fr.parallel_apply(fn, [], [])
    with pytest.raises(ValueError, match=r"fr\.parallel_apply: devices is empty"):
        fr.parallel_apply(fn, [0], [()], devices=[])


# --------------------------------------------------------------------------- data_parallel vs the stateful oracle


class Nested(nn.Module):
    """Nested inputs, kwargs, and an output with a 0-dim and a non-tensor leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(2, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, inp: dict[str, Any], *, scale: torch.Tensor, tag: str = "t") -> Any:
        h = self.bn(self.a(inp["x"]) + self.b(inp["pair"][0]) * scale[:, None])
        return {"h": h, "extra": (inp["pair"][1] * 2,), "mean": (h**2).mean(), "tag": tag}


def _nested_loss(out: Any) -> torch.Tensor:
    return out["h"].pow(2).sum() + out["h"].sum() + out["extra"][0].sum() + out["mean"].sum()


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum() + out.sum()


def _models() -> dict[str, tuple[nn.Module, Any, Any]]:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    return {
        "mlp": (
            nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)),
            (torch.randn(6, 5),),
            {},
        ),
        "conv": (
            nn.Sequential(
                nn.Conv2d(2, 3, 3, padding=1),
                nn.BatchNorm2d(3),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(48, 2),
            ),
            (torch.randn(6, 2, 4, 4),),
            {},
        ),
        "bn": (
            nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)),
            (torch.randn(6, 5),),
            {},
        ),
        "tied": (nn.Sequential(lin, nn.Tanh(), lin), (torch.randn(6, 4),), {}),
        "nested": (
            Nested(),
            ({"x": torch.randn(6, 4), "pair": [torch.randn(6, 2), torch.randn(6, 1)]},),
            {"scale": torch.randn(6), "tag": "z"},
        ),
    }


MODELS = _models()


def _fr_step(
    module: nn.Module, inputs: Any, kwargs: Any, devices: list[str], loss_fn: Any, **options: Any
) -> tuple[Any, dict[str, torch.Tensor], fr.State]:
    s = fr.state(module)
    params = {k: v.clone().requires_grad_() for k, v in s.params.items()}
    buffers = {k: v.clone() for k, v in s.buffers.items()}
    given = fr.State(params, buffers)
    snap = snapshot(given, inputs, kwargs, s)
    out, new = fr.data_parallel(module, given, *inputs, devices=devices, **kwargs, **options)
    assert_unchanged(snap)
    assert new.params is params
    names = list(params)
    grads = torch.autograd.grad(
        loss_fn(out), [params[k] for k in names], allow_unused=True, materialize_grads=True
    )
    return out, dict(zip(names, grads)), new


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=len)
@pytest.mark.parametrize("name", list(MODELS))
def test_data_parallel_equals_the_stateful_replicas(name: str, devices: list[str]) -> None:
    module, inputs, kwargs = MODELS[name]
    loss_fn = _nested_loss if name == "nested" else _loss
    out, grads, new = _fr_step(module, inputs, kwargs, devices, loss_fn)
    ref_out, ref_grads, ref_buffers, _ = oracles.stateful_data_parallel(
        module, inputs, kwargs, len(devices), loss_fn
    )
    assert_trees_close(out, ref_out, rtol=1e-6, atol=1e-6)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-6)
    assert_trees_close(new.buffers, ref_buffers, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("name", "batch"), [("mlp", 2), ("bn", 4)])
def test_data_parallel_with_a_batch_smaller_than_the_devices(name: str, batch: int) -> None:
    module, inputs, _ = MODELS[name]
    inputs = (inputs[0][:batch],)
    devices = ["cpu"] * 3
    out, grads, new = _fr_step(module, inputs, {}, devices, _loss)
    ref_out, ref_grads, ref_buffers, copies = oracles.stateful_data_parallel(
        module, inputs, {}, 3, _loss
    )
    assert len(copies) == 2
    assert_trees_close(out, ref_out, rtol=1e-6, atol=1e-6)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-6)
    assert_trees_close(new.buffers, ref_buffers, rtol=1e-6, atol=1e-6)


def test_data_parallel_buffers_mean_averages_floating_buffers() -> None:
    module, inputs, _ = MODELS["bn"]
    _, _, new = _fr_step(module, inputs, {}, ["cpu"] * 3, _loss, buffers="mean")
    _, _, _, copies = oracles.stateful_data_parallel(module, inputs, {}, 3, _loss)
    per_copy = [dict(c.named_buffers()) for c in copies]
    for k, v in new.buffers.items():
        if v.is_floating_point():
            torch.testing.assert_close(v, torch.stack([b[k] for b in per_copy]).mean(0))
        else:
            torch.testing.assert_close(v, per_copy[0][k], rtol=0, atol=0)
    assert int(new.buffers["1.num_batches_tracked"]) == 1


def test_data_parallel_under_torch_func_grad_equals_the_oracle() -> None:
    module, inputs, kwargs = MODELS["nested"]
    s = fr.state(module)
    snap = snapshot(s, inputs, kwargs)

    def f(params: dict[str, torch.Tensor]) -> torch.Tensor:
        out, _ = fr.data_parallel(
            module, fr.State(params, s.buffers), *inputs, devices=["cpu"] * 2, **kwargs
        )
        return _nested_loss(out)

    grads = torch.func.grad(f)(s.params)
    assert_unchanged(snap)
    _, ref_grads, _, _ = oracles.stateful_data_parallel(module, inputs, kwargs, 2, _nested_loss)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-6)


def test_data_parallel_runs_replicas_concurrently() -> None:
    class Meet(nn.Module):
        def __init__(self, parties: int) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.barrier = threading.Barrier(parties, timeout=20)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.barrier.wait()
            return self.lin(x)

    m = Meet(3)
    before = threading.active_count()
    out, _ = fr.data_parallel(m, fr.state(m), torch.randn(6, 2), devices=["cpu"] * 3)
    assert out.shape == (6, 2) and threading.active_count() == before


def test_data_parallel_output_device_dim_and_no_inputs() -> None:
    torch.manual_seed(1)
    lin = nn.Linear(3, 2)
    x = torch.randn(2, 6, 3)
    out, _ = fr.data_parallel(
        lin, fr.state(lin), x, devices=["cpu", "cpu"], dim=1, output_device="meta"
    )
    assert out.device.type == "meta" and out.shape == (2, 6, 2)
    out, _ = fr.data_parallel(lin, fr.state(lin), x, devices=["cpu"] * 3, dim=1)
    torch.testing.assert_close(out, lin(x).detach())

    class Const(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self) -> torch.Tensor:
            return self.w * 2

    c = Const()
    out, _ = fr.data_parallel(c, fr.state(c), devices=["cpu", "cpu"])
    torch.testing.assert_close(out, torch.full((2,), 2.0))  # one replica, as nn.DataParallel


def test_data_parallel_on_one_device_gathers_nothing_as_nn_dataparallel() -> None:
    # nn.DataParallel with one device calls the module directly: a 0-dim output stays 0-dim
    class Total(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> dict[str, Any]:
            return {"total": self.lin(x).sum(), "rows": self.lin(x)}

    m, x = Total(), torch.randn(3, 2)
    out, _ = fr.data_parallel(m, fr.state(m), x, devices=["cpu"])
    assert_trees_close(out, m(x), rtol=0, atol=0)
    assert out["total"].shape == ()
    out, _ = fr.data_parallel(m, fr.state(m), x, devices=["cpu"], output_device="meta")
    assert out["total"].device.type == "meta" and out["total"].shape == ()
    # two devices with one shard still gather, as nn.DataParallel does
    out, _ = fr.data_parallel(m, fr.state(m), x[:1], devices=["cpu", "cpu"])
    assert out["total"].shape == (1,)


def test_data_parallel_reports_the_failing_replica() -> None:
    lin = nn.Linear(3, 2)
    with pytest.raises(
        RuntimeError, match=r"fr\.data_parallel: replica 0 on cpu raised RuntimeError: .*shapes"
    ):
        fr.data_parallel(lin, fr.state(lin), torch.randn(4, 5), devices=["cpu", "cpu"])


def test_data_parallel_rejects_bad_input() -> None:
    lin = nn.Linear(3, 2)
    s, x = fr.state(lin), torch.randn(4, 3)
    snap = snapshot(s, x)
    with pytest.raises(
        ValueError, match=r"fr\.data_parallel: buffers must be 'first' or 'mean', got 'last'"
    ):
        fr.data_parallel(lin, s, x, devices=["cpu"], buffers="last")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fr\.data_parallel: devices is empty"):
        fr.data_parallel(lin, s, x, devices=[])
    with pytest.raises(
        TypeError,
        match=r"fr\.data_parallel: state must be an fr\.State\(params, buffers\), got dict",
    ):
        fr.data_parallel(lin, dict(s.params), x, devices=["cpu"])  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"fr\.data_parallel: dim=3 is out of range for the tensor at inputs\[0\] of shape \(4, 3\)",
    ):
        fr.data_parallel(lin, s, x, devices=["cpu"], dim=3)
    with pytest.raises(
        ValueError, match=r"fr\.data_parallel: the tensor at kwargs\['scale'\] is 0-dim"
    ):
        fr.data_parallel(lin, s, x, devices=["cpu"], scale=torch.tensor(2.0))
    with pytest.raises(ValueError, match=r"fr\.data_parallel: output_device is not a device"):
        fr.data_parallel(lin, s, x, devices=["cpu"], output_device="nope")
    assert_unchanged(snap)


def _to_cuda(tree: Any) -> Any:
    return optree.tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, tree)


@needs_cuda
@pytest.mark.parametrize("name", ["mlp", "conv", "bn", "nested"])
def test_data_parallel_equals_nn_dataparallel_on_cuda(name: str) -> None:
    module, inputs, kwargs = MODELS[name]
    loss_fn = _nested_loss if name == "nested" else _loss
    module = copy.deepcopy(module).cuda()
    inputs, kwargs = _to_cuda((inputs, kwargs))
    ids = list(range(torch.cuda.device_count()))
    stateful = copy.deepcopy(module)
    ref_out = nn.DataParallel(stateful, device_ids=ids)(*inputs, **kwargs)
    loss_fn(ref_out).backward()
    out, grads, new = _fr_step(module, inputs, kwargs, [f"cuda:{i}" for i in ids], loss_fn)
    assert_trees_close(out, ref_out, rtol=1e-5, atol=1e-5)
    assert_trees_close(
        grads, {k: p.grad for k, p in stateful.named_parameters()}, rtol=1e-4, atol=1e-5
    )
    assert_trees_close(new.buffers, dict(stateful.named_buffers()), rtol=1e-5, atol=1e-5)


@needs_cuda
@pytest.mark.parametrize("name", ["conv", "nested"])
def test_data_parallel_on_one_gpu_twice_equals_the_stateful_replicas(name: str) -> None:
    # two replicas on one GPU, each on a stream of its own
    module, inputs, kwargs = MODELS[name]
    loss_fn = _nested_loss if name == "nested" else _loss
    module = copy.deepcopy(module).cuda()
    inputs, kwargs = _to_cuda((inputs, kwargs))
    out, grads, new = _fr_step(module, inputs, kwargs, ["cuda:0", "cuda:0"], loss_fn)
    ref_out, ref_grads, ref_buffers, _ = oracles.stateful_data_parallel(
        module, inputs, kwargs, 2, loss_fn
    )
    assert_trees_close(out, ref_out, rtol=1e-5, atol=1e-5)
    assert_trees_close(grads, ref_grads, rtol=1e-4, atol=1e-5)
    assert_trees_close(new.buffers, ref_buffers, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- all_reduce


def test_all_reduce_sums_and_averages_onto_each_tree() -> None:
    torch.manual_seed(2)
    trees = [
        {"w": torch.randn(3, 2), "b": [torch.randn(2), "tag"], "i": torch.tensor([i, 2 * i])}
        for i in range(3)
    ]
    snap = snapshot(trees)
    total_w = trees[0]["w"] + trees[1]["w"] + trees[2]["w"]
    summed = fr.all_reduce(trees, op="sum")
    assert_unchanged(snap)
    assert len(summed) == 3
    for tree in summed:
        torch.testing.assert_close(tree["w"], total_w)
        torch.testing.assert_close(tree["i"], torch.tensor([3, 6]))
        assert tree["b"][1] == "tag"
        assert all(tree["w"] is not t["w"] for t in trees)
    means = fr.all_reduce([{"w": t["w"], "b": t["b"]} for t in trees])
    assert_unchanged(snap)
    torch.testing.assert_close(means[2]["w"], total_w / 3)
    torch.testing.assert_close(means[0]["b"][0], sum(t["b"][0] for t in trees) / 3)


def test_all_reduce_of_one_tree_is_a_copy() -> None:
    t = {"w": torch.randn(3)}
    (out,) = fr.all_reduce([t])
    torch.testing.assert_close(out["w"], t["w"])
    assert out["w"].data_ptr() != t["w"].data_ptr()


def test_all_reduce_keeps_tied_leaves_tied() -> None:
    a, b = torch.randn(2), torch.randn(2)
    out = fr.all_reduce([[a, a], [b, b]], op="sum")
    assert out[0][0] is out[0][1]
    torch.testing.assert_close(out[1][1], a + b)


def test_all_reduce_is_differentiable() -> None:
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    out = fr.all_reduce([{"x": a}, {"x": b}])
    (out[0]["x"] * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    torch.testing.assert_close(a.grad, torch.tensor([0.5, 1.0, 1.5]))
    torch.testing.assert_close(b.grad, torch.tensor([0.5, 1.0, 1.5]))


def test_all_reduce_rejects_bad_input() -> None:
    t = torch.ones(2)
    with pytest.raises(
        ValueError,
        match=r"fr\.all_reduce: trees differ at \['a'\]: dict with keys \('x',\) in tree 0, dict with keys \('y',\) in tree 1",
    ):
        fr.all_reduce([{"a": {"x": t}}, {"a": {"y": t}}])
    with pytest.raises(
        ValueError,
        match=r"fr\.all_reduce: trees differ at \['w'\]: torch\.float32 of shape \(2,\) in tree 0, torch\.float32 of shape \(3,\) in tree 1",
    ):
        fr.all_reduce([{"w": t}, {"w": torch.ones(3)}])
    with pytest.raises(
        ValueError,
        match=r"fr\.all_reduce: trees differ at \[1\]: torch\.float32 of shape \(2,\) in tree 0, torch\.float64 of shape \(2,\) in tree 1",
    ):
        fr.all_reduce([[t, t], [t, t.double()]])
    with pytest.raises(
        ValueError,
        match=r"fr\.all_reduce: trees differ at \[0\]: a tensor of shape \(2,\) and dtype torch\.float32 in tree 0, a str \('x'\) in tree 1",
    ):
        fr.all_reduce([[t], ["x"]])
    with pytest.raises(
        TypeError,
        match=r"fr\.all_reduce: op='mean' needs floating-point or complex leaves, but the leaf at \['n'\] is torch\.bool",
    ):
        fr.all_reduce([{"n": torch.tensor(True)}] * 2)
    with pytest.raises(ValueError, match=r"fr\.all_reduce: op must be 'sum' or 'mean', got 'max'"):
        fr.all_reduce([[t]], op="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fr\.all_reduce: trees is empty"):
        fr.all_reduce([])


# --------------------------------------------------------------------------- data_parallel_grad


def _mlp_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ params["w1"].T + params["b1"])
    return F.cross_entropy(h @ params["w2"].T, y)


def _mlp_params() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return {"w1": torch.randn(6, 4), "b1": torch.randn(6), "w2": torch.randn(3, 6)}


@pytest.mark.parametrize("devices", [*DEVICE_LISTS, ["cpu"] * 4], ids=len)
def test_data_parallel_grad_equals_the_full_batch_gradient(devices: list[str]) -> None:
    params = _mlp_params()
    x, y = torch.randn(12, 4), torch.randint(0, 3, (12,))
    snap = snapshot(params, x, y)
    grads, loss = fr.data_parallel_grad(_mlp_loss, devices)(params, x, y)
    assert_unchanged(snap)
    ref_grads, ref_loss = torch.func.grad_and_value(_mlp_loss)(params, x, y)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss)


def test_data_parallel_grad_equals_a_stateful_backward() -> None:
    module, (x,), _ = MODELS["mlp"]
    y = torch.randint(0, 3, (x.shape[0],))
    stateful = copy.deepcopy(module)
    F.cross_entropy(stateful(x), y).backward()

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fr.apply(module, fr.State(params, {}), x)[0], y)

    grads, _ = fr.data_parallel_grad(loss_fn, ["cpu", "cpu", "cpu"])(fr.state(module).params, x, y)
    assert_trees_close(
        grads, {k: p.grad for k, p in stateful.named_parameters()}, rtol=1e-5, atol=1e-6
    )


def test_data_parallel_grad_sum_aux_and_uneven_shards() -> None:
    params = _mlp_params()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))

    def with_aux(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        return _mlp_loss(p, x, y), {"n": torch.tensor(x.shape[0]), "name": "r"}

    # 5 rows on 4 devices: torch.chunk gives 2 + 2 + 1, three replicas
    grads, (loss, aux) = fr.data_parallel_grad(with_aux, ["cpu"] * 4, op="sum", has_aux=True)(
        params, x, y
    )
    parts = [(x[:2], y[:2]), (x[2:4], y[2:4]), (x[4:], y[4:])]
    per = [torch.func.grad_and_value(_mlp_loss)(params, *p) for p in parts]
    expected = {k: sum(g[k] for g, _ in per) for k in params}
    assert_trees_close(grads, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, torch.stack([v for _, v in per]).mean())
    assert aux["name"] == "r"
    torch.testing.assert_close(aux["n"], torch.tensor([2, 2, 1]))


def test_data_parallel_grad_rejects_bad_input() -> None:
    with pytest.raises(
        ValueError, match=r"fr\.data_parallel_grad: op must be 'sum' or 'mean', got 'avg'"
    ):
        fr.data_parallel_grad(_mlp_loss, ["cpu"], op="avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fr\.data_parallel_grad: devices is empty"):
        fr.data_parallel_grad(_mlp_loss, [])
    step = fr.data_parallel_grad(_mlp_loss, ["cpu", "cpu"])
    with pytest.raises(
        ValueError, match=r"fr\.data_parallel_grad: the tensor at batch\[1\] is 0-dim"
    ):
        step(_mlp_params(), torch.randn(4, 4), torch.tensor(1))


@needs_cuda
def test_all_reduce_and_data_parallel_grad_across_cpu_and_cuda() -> None:
    a, b = torch.randn(3, 2), torch.randn(3, 2)
    out = fr.all_reduce(
        [{"w": a, "n": torch.tensor([1])}, {"w": b.cuda(), "n": torch.tensor([2]).cuda()}], op="sum"
    )
    assert out[0]["w"].device.type == "cpu" and out[1]["w"].device.type == "cuda"
    torch.testing.assert_close(out[1]["w"].cpu(), a + b)
    torch.testing.assert_close(out[0]["n"], torch.tensor([3]))

    params = _mlp_params()
    x, y = torch.randn(12, 4), torch.randint(0, 3, (12,))
    grads, loss = fr.data_parallel_grad(_mlp_loss, ["cuda:0", "cpu"])(params, x, y)
    ref_grads, ref_loss = torch.func.grad_and_value(_mlp_loss)(params, x, y)
    assert all(g.device.type == "cpu" for g in grads.values())
    assert_trees_close(grads, ref_grads, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss.cpu(), ref_loss, rtol=1e-5, atol=1e-6)


def test_data_parallel_grad_and_all_reduce_compose_with_vmap_and_grad() -> None:
    # an ensemble of 3 parameter sets, each stepped data-parallel on the same batch
    torch.manual_seed(4)
    stacked = {"w1": torch.randn(3, 6, 4), "b1": torch.randn(3, 6), "w2": torch.randn(3, 3, 6)}
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    step = fr.data_parallel_grad(_mlp_loss, ["cpu", "cpu"])
    grads, loss = torch.func.vmap(step, in_dims=(0, None, None))(stacked, x, y)
    ref = torch.func.vmap(torch.func.grad_and_value(_mlp_loss), in_dims=(0, None, None))
    ref_grads, ref_loss = ref(stacked, x, y)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss)

    a, b = torch.randn(3, 2), torch.randn(3, 2)
    mean = torch.func.vmap(lambda a, b: fr.all_reduce([{"x": a}, {"x": b}])[0]["x"])(a, b)
    torch.testing.assert_close(mean, (a + b) / 2)
    g = torch.func.grad(lambda a: (fr.all_reduce([{"x": a}, {"x": b}])[1]["x"] * 3).sum())(a)
    torch.testing.assert_close(g, torch.full((3, 2), 1.5))


def test_data_parallel_under_vmap_runs_an_ensemble() -> None:
    torch.manual_seed(5)
    template = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    members = [nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)) for _ in range(3)]
    params, _ = torch.func.stack_module_state(members)  # type: ignore[arg-type]
    x = torch.randn(6, 4)

    def run(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return fr.data_parallel(template, fr.State(p, {}), x, devices=["cpu", "cpu"])[0]

    out = torch.func.vmap(run)(params)
    torch.testing.assert_close(out, torch.stack([mm(x) for mm in members]).detach())


# --------------------------------------------------------------------------- data_parallel_grad: buffers, frozen


def _bn_model() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def _bn_loss(
    model: nn.Module,
) -> Any:
    def loss_fn(
        trainable: dict[str, torch.Tensor],
        frozen: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out, new = fr.apply(model, fr.State(fr.combine(trainable, frozen), buffers), x)
        return F.cross_entropy(out, y), new.buffers

    return loss_fn


@pytest.mark.parametrize("aux", ["first", "mean"])
@pytest.mark.parametrize("n", [2, 3])
def test_data_parallel_grad_carries_buffers_as_the_stateful_replicas(aux: Any, n: int) -> None:
    # issue 11, item 7: closed-over buffers came back concatenated, (16,) -> (32,)
    model = _bn_model()
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    params, buffers = fr.state(model)
    snap = snapshot(params, buffers, x, y)
    step = fr.data_parallel_grad(_bn_loss(model), ["cpu"] * n, replicated=2, has_aux=True, aux=aux)
    grads, (loss, new_buffers) = step(params, {}, buffers, x, y)
    assert_unchanged(snap)

    def stateful_loss(c: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(c(x), y)

    ref_grads, ref_loss, copies = oracles.stateful_replica_grads(model, (x, y), n, stateful_loss)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss)
    per_copy = [dict(c.named_buffers()) for c in copies]
    expected = {
        k: (
            torch.stack([b[k] for b in per_copy]).mean(0)
            if aux == "mean" and v.is_floating_point()
            else v
        )
        for k, v in per_copy[0].items()
    }
    assert list(new_buffers) == list(buffers)
    assert new_buffers["1.running_mean"].shape == (16,)
    assert_trees_close(new_buffers, expected, rtol=1e-5, atol=1e-6)
    assert int(new_buffers["1.num_batches_tracked"]) == 1


def test_data_parallel_grad_leaves_frozen_parameters_alone() -> None:
    model = _bn_model()
    model[0].requires_grad_(False)  # fine-tuning: the first layer frozen
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    params, buffers = fr.state(model)
    trainable, frozen = fr.partition(params, model)
    snap = snapshot(frozen)
    frozen_before = {k: v.clone() for k, v in frozen.items()}
    step = fr.data_parallel_grad(
        _bn_loss(model), ["cpu", "cpu"], replicated=2, has_aux=True, aux="first"
    )
    grads, (loss, _) = step(trainable, frozen, buffers, x, y)
    assert list(grads) == list(trainable) == ["1.weight", "1.bias", "3.weight", "3.bias"]

    def stateful_loss(c: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(c(x), y)

    ref_grads, ref_loss, copies = oracles.stateful_replica_grads(model, (x, y), 2, stateful_loss)
    assert all(c[0].weight.grad is None for c in copies)  # the stateful design agrees
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss)
    assert_unchanged(snap)
    for k, v in frozen.items():  # bit-identical, and updated by nothing
        assert torch.equal(v, frozen_before[k]) and not v.requires_grad


def test_data_parallel_grad_replicated_arguments_reach_every_replica() -> None:
    # replicated like params (objects of their own on each device), not scattered
    seen: list[torch.Tensor] = []

    def loss_fn(p: dict[str, torch.Tensor], c: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
        seen.append(c["k"])
        assert c["tag"] == "t" and x.shape == (2, 3)
        return (x @ p["w"] * c["k"]).mean()

    w, k = {"w": torch.ones(3)}, {"k": torch.tensor(2.0), "tag": "t"}
    x = torch.arange(12.0).reshape(4, 3)
    grads, loss = fr.data_parallel_grad(loss_fn, ["cpu", "cpu"], replicated=1)(w, k, x)
    torch.testing.assert_close(grads["w"], 2 * x.mean(0))
    torch.testing.assert_close(loss, (x @ w["w"] * 2).mean())
    assert len({id(t) for t in seen}) == 2 and all(t is not k["k"] for t in seen)
    assert all(t.data_ptr() == k["k"].data_ptr() for t in seen)  # zero copy


def test_data_parallel_grad_aux_gathers_by_default() -> None:
    # the old behaviour, documented: without aux=, the replicas' aux are gathered
    model = _bn_model()
    params, buffers = fr.state(model)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    step = fr.data_parallel_grad(_bn_loss(model), ["cpu", "cpu"], replicated=2, has_aux=True)
    _, (_, gathered) = step(params, {}, buffers, x, y)
    assert gathered["1.running_mean"].shape == (32,)


def test_data_parallel_grad_rejects_bad_replicated_and_aux() -> None:
    with pytest.raises(
        ValueError,
        match=r"fr\.data_parallel_grad: aux='first' says how the replicas' aux combine, but "
        r"loss_fn returns no aux; pass has_aux=True",
    ):
        fr.data_parallel_grad(_mlp_loss, ["cpu"], aux="first")
    with pytest.raises(
        ValueError,
        match=r"fr\.data_parallel_grad: aux must be 'gather', 'first' or 'mean', got 'x'",
    ):
        fr.data_parallel_grad(_mlp_loss, ["cpu"], has_aux=True, aux="x")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"fr\.data_parallel_grad: replicated must be >= 0, got -1"
    ):
        fr.data_parallel_grad(_mlp_loss, ["cpu"], replicated=-1)
    with pytest.raises(TypeError, match=r"fr\.data_parallel_grad: replicated must be an int"):
        fr.data_parallel_grad(_mlp_loss, ["cpu"], replicated=1.0)  # type: ignore[arg-type]
    step = fr.data_parallel_grad(_mlp_loss, ["cpu"], replicated=3)
    with pytest.raises(
        TypeError,
        match=r"fr\.data_parallel_grad: step takes params, then replicated=3 argument\(s\), then "
        r"the batch; got 2 argument\(s\) after params",
    ):
        step(_mlp_params(), torch.randn(4, 4), torch.tensor([0, 1, 2, 0]))

    def uneven(p: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
        return (x @ p["w"]).mean(), ({"a": x.sum()} if x[0, 0] > 0 else [x.sum()])

    step = fr.data_parallel_grad(uneven, ["cpu", "cpu"], has_aux=True, aux="mean")
    with pytest.raises(
        ValueError,
        match=r"fr\.data_parallel_grad: aux='mean' needs the replicas' aux of one structure; "
        r"replicas differ at the root: dict with keys \('a',\) in replica 0, list of 1 in replica 1",
    ):
        step({"w": torch.ones(2)}, torch.tensor([[1.0, 0.0], [-1.0, 0.0]]))


# --------------------------------------------------------------------------- a forward that touches its state


class TouchesItsState(nn.Module):
    """A forward that clears its parameters' gradients, and may write them (issue 11, item 5)."""

    def __init__(self, write: bool) -> None:
        super().__init__()
        self.write = write
        self.lin = nn.Linear(5, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.zero_grad()
        if self.write:
            for p in self.parameters():
                p.grad = torch.full_like(p, 5.0)
        return self.bn(self.lin(x))


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("requires_grad", [False, True], ids=["state", "leaves"])
@pytest.mark.parametrize("write", [False, True], ids=["zero_grad", "writes_grad"])
def test_a_forward_that_touches_its_state_leaves_the_callers_alone(
    write: bool, requires_grad: bool
) -> None:
    # replicas on the caller's device shared its tensor objects: a replica's zero_grad()
    # cleared the caller's .grad, and threads writing .grad at once segfaulted
    torch.manual_seed(8)
    m = TouchesItsState(write)
    s = fr.state(m)
    params = {k: v.clone().requires_grad_(requires_grad) for k, v in s.params.items()}
    for p in params.values():
        p.grad = torch.full_like(p, 7.0)
    given = fr.State(params, s.buffers)
    x = torch.randn(9, 5)
    snap = snapshot(given, x)
    for _ in range(8):  # the crash came in 3 runs of 6
        out, _ = fr.data_parallel(m, given, x, devices=["cpu"] * 3)
        assert_unchanged(snap)
        assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in params.values())
    ref_out, ref_grads, _, _ = oracles.stateful_data_parallel(m, (x,), {}, 3, _loss)
    torch.testing.assert_close(out, ref_out)
    if requires_grad and not write:  # the oracle's copies keep what the forward writes
        got = torch.autograd.grad(_loss(out), list(params.values()))
        assert_trees_close(dict(zip(params, got)), ref_grads, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in params.values())

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return _loss(fr.apply(m, fr.State(p, s.buffers), x)[0])

    for _ in range(4):
        fr.data_parallel_grad(loss_fn, ["cpu"] * 3)(params, x)
        assert_unchanged(snap)
        assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in params.values())


# --------------------------------------------------------------------------- randomness


def _noisy() -> nn.Module:
    torch.manual_seed(9)
    return nn.Sequential(nn.Linear(5, 32), nn.Dropout(0.5), nn.Tanh(), nn.Linear(32, 3)).train()


@pytest.mark.parametrize("n", [2, 3])
def test_dropout_under_data_parallel_is_fixed_by_the_seed(n: int) -> None:
    # replica threads raced for the CPU generator: 2 distinct losses in 20 seeded steps
    m = _noisy()
    s = fr.state(m)
    x = torch.randn(12, 5)

    def seeded() -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(123)
        out, _ = fr.data_parallel(m, s, x, devices=["cpu"] * n)
        return out, torch.get_rng_state()

    first, state = seeded()
    for _ in range(20):
        out, after = seeded()
        assert torch.equal(out, first) and torch.equal(after, state)
    # replica i draws after replica i - 1, as the stateful copies called in order do
    torch.manual_seed(123)
    ref_out, _, _, _ = oracles.stateful_data_parallel(m, (x,), {}, n, _loss)
    assert torch.equal(first, ref_out)
    assert torch.equal(state, torch.get_rng_state())  # the caller's generator, advanced alike


@pytest.mark.parametrize("n", [2, 3])
def test_dropout_under_data_parallel_grad_is_fixed_by_the_seed(n: int) -> None:
    m = _noisy()
    params = fr.state(m).params
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fr.apply(m, fr.State(p, {}), x)[0], y)

    step = fr.data_parallel_grad(loss_fn, ["cpu"] * n)

    def seeded() -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        torch.manual_seed(321)
        grads, loss = step(params, x, y)
        return grads, loss, torch.get_rng_state()

    first = seeded()
    for _ in range(20):
        grads, loss, after = seeded()
        assert torch.equal(loss, first[1]) and torch.equal(after, first[2])
        assert all(torch.equal(grads[k], first[0][k]) for k in grads)

    def stateful_loss(c: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(c(x), y)

    torch.manual_seed(321)
    ref_grads, ref_loss, _ = oracles.stateful_replica_grads(m, (x, y), n, stateful_loss)
    assert_trees_close(first[0], ref_grads, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(first[1], ref_loss, rtol=1e-6, atol=1e-7)
    assert torch.equal(first[2], torch.get_rng_state())


def test_replicas_run_in_order_only_while_they_draw_random_numbers() -> None:
    threads: list[int] = []

    class Noted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            threads.append(threading.get_ident())
            return self.drop(self.lin(x))

    m = Noted()
    s, x = fr.state(m), torch.randn(4, 3)

    def ran() -> set[int]:
        threads.clear()
        fr.data_parallel(m, s, x, devices=["cpu", "cpu"])
        return set(threads)

    here = {threading.get_ident()}
    assert len(ran()) == 2 and len(threads) == 4  # drew: threads, then again in order
    assert ran() == here and len(threads) == 2  # known to draw: in order at once
    m.eval()
    assert ran() == here  # in order, and found to draw nothing ...
    assert len(ran()) == 2  # ... so in threads again
    m.train()


# --------------------------------------------------------------------------- float16 means


def test_all_reduce_mean_in_float16_divides_before_it_sums() -> None:
    # issue 11, item 7: the sum 12e4 overflowed float16 (inf); DDP divides first
    out = fr.all_reduce([{"w": torch.tensor([6e4], dtype=torch.half)}] * 2, op="mean")
    assert all(torch.equal(o["w"], torch.tensor([6e4], dtype=torch.half)) for o in out)
    for dtype in (torch.float16, torch.bfloat16):
        trees = [
            {"w": torch.tensor([5e4, 1.0, 3.0], dtype=dtype) * s, "f": torch.ones(2) * s}
            for s in (1.0, 0.5, 0.25)
        ]
        ddp = trees[0]["w"] / 3 + trees[1]["w"] / 3 + trees[2]["w"] / 3
        got = fr.all_reduce(trees, op="mean")
        assert got[0]["w"].dtype == dtype and torch.equal(got[0]["w"], ddp)
        torch.testing.assert_close(got[2]["f"], torch.full((2,), 1.75 / 3))
        # the same through autograd
        leaves = [{"w": t["w"].clone().requires_grad_()} for t in trees]
        got = fr.all_reduce(leaves, op="mean")
        assert torch.equal(got[1]["w"].detach(), ddp)


def test_data_parallel_grad_in_float16_stays_finite() -> None:
    # a float16 model whose full-batch gradient is 4e4: each replica's 4e4 summed to inf
    params = {"w": torch.ones(1, dtype=torch.half)}
    x = torch.full((8, 1), 4e4, dtype=torch.half)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (x * p["w"]).mean()

    grads, loss = fr.data_parallel_grad(loss_fn, ["cpu", "cpu"])(params, x)
    assert grads["w"].dtype == torch.half and torch.equal(grads["w"], torch.tensor([4e4]).half())
    assert torch.isfinite(loss) and loss.item() == 4e4


# --------------------------------------------------------------------------- torch.compile


def _tiny() -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    return model, fr.state(model).params, torch.randn(8, 4), torch.randint(0, 3, (8,))


def test_data_parallel_grad_compiles_to_one_graph_equal_to_eager() -> None:
    # issue 12, item 3: the replica threads broke the graph (7 graphs, 6 breaks); here with
    # frozen parameters and buffers replicated, and the buffers' mean as aux
    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    model[0].requires_grad_(False)
    params, buffers = fr.state(model)
    trainable, frozen = fr.partition(params, model)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    step = fr.data_parallel_grad(
        _bn_loss(model), ["cpu", "cpu"], replicated=2, has_aux=True, aux="mean"
    )
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(trainable, frozen, buffers, x, y)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert_trees_close(
        compiled(trainable, frozen, buffers, x, y),
        step(trainable, frozen, buffers, x, y),
        rtol=1e-6,
        atol=1e-7,
    )


def test_data_parallel_compiles_to_one_graph_equal_to_eager() -> None:
    # differentiated through: the replicas' aliases must stay in the transform's graph
    model, params, x, y = _tiny()

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, _ = fr.data_parallel(model, fr.State(p, {}), x, devices=["cpu", "cpu"])
        return F.cross_entropy(out, y)

    step = fr.grad_and_value(loss_fn)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(params, x, y)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    grads, loss = torch.compile(step, backend="aot_eager", fullgraph=True)(params, x, y)
    eager_grads, eager_loss = step(params, x, y)
    assert_trees_close(grads, eager_grads, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(loss, eager_loss)
