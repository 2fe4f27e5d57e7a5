"""``fr.replicate``: structure, sharing, aliasing, coalescing, gradients, and every error's words."""

from __future__ import annotations

import copy
from collections import namedtuple
from typing import Any

import optree
import pytest
import torch
from torch import nn

import freplicate as fr
from freplicate import _pack

CPU, META = torch.device("cpu"), torch.device("meta")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")

Pair = namedtuple("Pair", "left right")


def make_tree() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    tied = torch.randn(3, 2, generator=g)
    return {
        "w": torch.randn(4, 3, generator=g),
        "tied_a": tied,
        "nested": [tied, (torch.arange(5), None), Pair(torch.tensor(2.5), "name")],
        "scalar": torch.tensor(True),
        "cplx": torch.randn(2, dtype=torch.complex64, generator=g),
        "half": torch.randn(3, generator=g).half(),
        "empty": torch.ones(0, 4),
        "n": 7,
        "obj": object(),
    }


def _leaves(tree: Any) -> list[Any]:
    return optree.tree_leaves(tree)


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in _leaves(tree) if isinstance(t, torch.Tensor)]


def guard(tree: Any) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    return [(t, t._version, t.detach().clone()) for t in tensor_leaves(tree)]


def assert_unchanged(snap: list[tuple[torch.Tensor, int, torch.Tensor]]) -> None:
    for t, version, value in snap:
        assert t._version == version and torch.equal(t, value)


def shares(got: torch.Tensor, src: torch.Tensor) -> bool:
    """``got`` is a tensor object of its own on ``src``'s very memory: zero copy, not ``src``."""
    return (
        got is not src
        and got.device == src.device
        and got.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
        and got.data_ptr() == src.data_ptr()
        and (got.shape, got.stride(), got.dtype) == (src.shape, src.stride(), src.dtype)
    )


def test_structure_values_dtypes_devices() -> None:
    tree = make_tree()
    snap = guard(tree)
    devices = ["cpu", "meta", torch.device("cpu"), "meta"]
    replicas = fr.replicate(tree, devices)
    assert len(replicas) == 4
    spec = optree.tree_structure(tree)
    for r, d in zip(replicas, devices):
        assert optree.tree_structure(r) == spec
        assert type(r["nested"][2]) is Pair
        for got, src in zip(_leaves(r), _leaves(tree)):
            if not isinstance(src, torch.Tensor):
                assert got is src  # non-tensor leaves by reference
                continue
            assert got.device == torch.device(d)
            assert got.dtype == src.dtype and got.shape == src.shape
            if got.device == CPU:
                assert shares(got, src)  # same device: a new object on the same memory
    assert_unchanged(snap)


def test_tied_leaves_stay_one_object_per_replica() -> None:
    tree = make_tree()
    cpu, meta, meta2 = fr.replicate(tree, ["cpu", "meta", "meta"])
    for r in (cpu, meta, meta2):
        assert r["tied_a"] is r["nested"][0]
    assert shares(cpu["tied_a"], tree["tied_a"])
    assert meta["tied_a"] is not cpu["tied_a"] and meta["tied_a"].device == META


def test_transfers_are_coalesced(monkeypatch: pytest.MonkeyPatch) -> None:
    moved: list[tuple[torch.dtype, int]] = []
    real = _pack.move

    def counting(flat: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        moved.append((flat.dtype, flat.numel()))
        return real(flat, *args, **kwargs)

    monkeypatch.setattr(_pack, "move", counting)
    tree = {f"l{i}": torch.ones(i + 1) for i in range(20)} | {"i": torch.arange(3), "t": None}
    tree["alias"] = tree["l0"]
    fr.replicate(tree, ["meta", "cpu", "meta", "cpu"])
    # one buffer per dtype, moved once to meta (the repeat reuses it), tied leaf once; every
    # float32 tensor but the last (optree takes dict keys sorted: l9) takes a multiple of 16
    # elements (64 bytes) of it
    sizes = [int(k[1:]) + 1 for k in sorted(f"l{i}" for i in range(20))]
    floats = sum(-(-n // 16) * 16 for n in sizes[:-1]) + sizes[-1]
    assert sorted(moved, key=str) == [(torch.float32, floats), (torch.int64, 3)]


def formats_tree() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    conv = torch.randn(5, 3, 2, 3, generator=g).to(memory_format=torch.channels_last)
    return {
        "conv": conv,
        "tied": conv,
        "depthwise": torch.randn(4, 1, 3, 3, generator=g).to(memory_format=torch.channels_last),
        "linear_t": torch.randn(7, 5, generator=g).t(),
        "volume": torch.randn(2, 3, 2, 2, 2, generator=g).to(memory_format=torch.channels_last_3d),
        "slice": torch.randn(6, 5, generator=g).t()[::2],  # not dense: laid out as .to() lays it
        "bias": torch.randn(3, generator=g),
        "n": 4,
    }


def test_replicas_keep_every_leafs_memory_format() -> None:
    """A replica's leaf has the strides ``leaf.to(device)`` gives it (the leaf's own, where it is
    dense); moved ones are views of one flat buffer, each 64-byte aligned in it."""
    tree = formats_tree()
    snap = guard(tree)
    devices = ["cpu", "meta", "cpu", "meta"]
    replicas = fr.replicate(tree, devices)
    assert_unchanged(snap)
    for device, replica in zip(devices, replicas):
        for k, t in tree.items():
            if isinstance(t, torch.Tensor):
                assert replica[k].stride() == t.to(device).stride(), (device, k)
        assert replica["conv"] is replica["tied"] and replica["n"] == 4
    moved = [t for t in tensor_leaves(replicas[1]) if t.device == META]
    offsets = {t.storage_offset() * t.element_size() % 64 for t in moved}
    assert offsets == {0}


def test_replicas_have_the_strides_of_per_replica_deep_copies() -> None:
    """The stateful oracle on CPU: ``copy.deepcopy(module).to(device)`` for each replica."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, groups=4), nn.Flatten()
    ).to(memory_format=torch.channels_last)
    for device in ("cpu", "meta"):
        (replica,) = fr.replicate(fr.state(model), [device])
        twin = copy.deepcopy(model).to(device)
        for name, p in twin.named_parameters():
            assert replica.params[name].stride() == p.stride(), (device, name)
        for name, b in twin.named_buffers():
            assert replica.buffers[name].stride() == b.stride(), (device, name)


def test_values_on_meta_and_back_through_apply() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    s = fr.state(m)
    replicas = fr.replicate(s, ["cpu", "cpu:0", "meta"])
    assert all(type(r) is fr.State for r in replicas)
    assert all(shares(a, b) for r in replicas[:2] for a, b in zip(_leaves(r), _leaves(s)))
    assert all(a is not b for a, b in zip(_leaves(replicas[0]), _leaves(replicas[1])))
    x = torch.randn(5, 3)
    out, _ = fr.apply(m, replicas[1], x)
    assert torch.equal(out, m(x))
    out_meta, bufs = fr.apply(m, replicas[2], x.to("meta"))
    assert out_meta.device == META and out_meta.shape == (5, 2)
    assert bufs.buffers["1.running_mean"].device == META


def test_parameters_and_no_tensor_trees() -> None:
    lin = nn.Linear(2, 2)
    params = dict(lin.named_parameters())
    (same,) = fr.replicate(params, ["cpu"])
    assert shares(same["weight"], lin.weight) and same["weight"].grad_fn is not None
    tree = {"a": 1, "b": [None, "x"]}
    assert fr.replicate(tree, ["cpu", "meta"]) == [tree, tree]


def test_a_state_on_its_device_is_shared_with_new_dicts() -> None:
    base = fr.state(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    s = fr.State({**base.params, "tie": base.params["0.weight"]}, base.buffers)  # one tensor twice
    snap = guard(s)
    replicas = fr.replicate(s, ["cpu", torch.device("cpu"), "cpu"])
    assert len(replicas) == 3
    for r in replicas:
        assert type(r) is fr.State and r.params is not s.params and r.buffers is not s.buffers
        assert list(r.params) == list(s.params) and list(r.buffers) == list(s.buffers)
        assert all(shares(r.params[k], v) for k, v in s.params.items())
        assert all(shares(r.buffers[k], v) for k, v in s.buffers.items())
        assert r.params["tie"] is r.params["0.weight"]  # tied: one object per replica
        r.params["new"] = torch.ones(1)  # each replica's dicts are its own
    assert "new" not in s.params and replicas[0].params is not replicas[1].params
    firsts = [r.params["0.weight"] for r in replicas]
    assert len(set(map(id, firsts))) == 3  # and its tensor objects its own
    assert_unchanged(snap)
    # what the general path (a tree that is not a State) builds: the same, up to the node type
    general = fr.replicate(tuple(s), ["cpu"])[0]
    assert list(general[0]) == list(s.params) and all(
        shares(general[0][k], v) for k, v in s.params.items()
    )
    assert general[0]["tie"] is general[0]["0.weight"]
    # a non-tensor leaf, a detached copy or another device: the general path, still a State
    odd = fr.State({"w": torch.ones(2), "n": None}, {})  # type: ignore[dict-item]
    (r_odd,) = fr.replicate(odd, ["cpu"])
    assert type(r_odd) is fr.State and shares(r_odd.params["w"], odd.params["w"])
    assert r_odd.params["n"] is None
    (meta,) = fr.replicate(s, ["meta"])
    assert type(meta) is fr.State and meta.params["tie"] is meta.params["0.weight"]
    (det,) = fr.replicate(s, ["cpu"], detach=True)
    assert type(det) is fr.State and torch.equal(det.params["tie"], s.params["tie"])


def oracle_copies(
    tree: dict[str, torch.Tensor], devices: list[str]
) -> list[dict[str, torch.Tensor]]:
    """The stateful way: every replica made with plain ``.to()``."""
    return [{k: v.to(d) for k, v in tree.items()} for d in devices]


def weighted(
    replicas: list[dict[str, torch.Tensor]], coeffs: list[dict[str, torch.Tensor]]
) -> torch.Tensor:
    return sum(
        ((r[k].to("cpu") * c[k]).sum() + (r[k] ** 2).sum() * (i + 1))
        for i, (r, c) in enumerate(zip(replicas, coeffs))
        for k in r
    )  # type: ignore[return-value]


def test_gradients_sum_over_replicas_like_to_copies_under_autograd() -> None:
    g = torch.Generator().manual_seed(1)
    devices = ["cpu", "cpu", "cpu"]
    tree = {"a": torch.randn(3, 2, generator=g), "b": torch.randn(4, generator=g)}
    coeffs = [{k: torch.randn(v.shape, generator=g) for k, v in tree.items()} for _ in devices]
    leaves = {k: v.clone().requires_grad_() for k, v in tree.items()}
    got = torch.autograd.grad(
        weighted(fr.replicate(leaves, devices), coeffs), list(leaves.values())
    )
    expected = torch.autograd.grad(
        weighted(oracle_copies(leaves, devices), coeffs), list(leaves.values())
    )
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    # and the sum really is over all replicas
    manual = sum(c["a"] + 2 * (i + 1) * leaves["a"].detach() for i, c in enumerate(coeffs))
    torch.testing.assert_close(got[0], manual)


def test_gradients_under_torch_func_grad_and_vjp() -> None:
    g = torch.Generator().manual_seed(2)
    devices = ["cpu", "cpu"]
    tree = {"a": torch.randn(3, generator=g), "b": torch.randn(2, 2, generator=g)}
    coeffs = [{k: torch.randn(v.shape, generator=g) for k, v in tree.items()} for _ in devices]
    got = torch.func.grad(lambda t: weighted(fr.replicate(t, devices), coeffs))(tree)
    expected = torch.func.grad(lambda t: weighted(oracle_copies(t, devices), coeffs))(tree)
    for k in tree:
        torch.testing.assert_close(got[k], expected[k])
    _, vjp = torch.func.vjp(lambda t: fr.replicate(t, devices), tree)
    (back,) = vjp(coeffs)
    for k in tree:
        torch.testing.assert_close(back[k], coeffs[0][k] + coeffs[1][k])
    assert all(t._version == 0 for t in tree.values())


def test_copies_stay_in_the_graph_unless_detach() -> None:
    w = torch.randn(3, requires_grad=True)
    cpu, meta = fr.replicate({"w": w}, ["cpu", "meta"])
    assert shares(cpu["w"], w) and meta["w"].requires_grad and meta["w"].grad_fn is not None
    assert cpu["w"].requires_grad and cpu["w"].grad_fn is not None  # a view: gradients flow to w
    (g,) = torch.autograd.grad((cpu["w"] * 2).sum(), w)
    assert torch.equal(g, torch.full((3,), 2.0))
    cpu, meta = fr.replicate({"w": w}, ["cpu", "meta"], detach=True)
    for r in (cpu, meta):
        assert not r["w"].requires_grad and r["w"].grad_fn is None
    assert cpu["w"].data_ptr() == w.data_ptr()  # detached, still not copied
    (r,) = fr.replicate({"w": w * 2}, ["cpu"], detach=True)
    assert r["w"].grad_fn is None
    # tied leaves stay one object per replica when detached too
    cpu, meta = fr.replicate({"x": w, "y": [w]}, ["cpu", "meta"], detach=True)
    assert cpu["x"] is cpu["y"][0] and meta["x"] is meta["y"][0]


@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["meta", "cpu", "meta", "cpu"]])
def test_every_replica_has_tensor_objects_of_its_own(devices: list[str]) -> None:
    # replicas run in threads of their own: one that sets .grad (or zero_grad()s) must
    # touch neither the caller's tensor objects nor another replica's (issue 11, item 5)
    w = torch.randn(3, 2, requires_grad=True)
    tree = {"w": w, "tied": w, "b": torch.randn(2), "s": fr.State({"v": torch.ones(1)}, {})}
    w.grad = torch.full_like(w, 7.0)
    snap = guard(tree)
    replicas = fr.replicate(tree, devices)
    objects = [id(t) for r in replicas for t in {id(x): x for x in tensor_leaves(r)}.values()]
    assert len(objects) == len(set(objects)) == 3 * len(devices)
    assert not {id(t) for t in tensor_leaves(tree)} & set(objects)
    for r, d in zip(replicas, devices):
        assert r["w"] is r["tied"]
        if d == "cpu":
            assert all(shares(a, b) for a, b in zip(tensor_leaves(r), tensor_leaves(tree)))
        r["w"].grad = torch.zeros_like(r["w"])  # what a forward's zero_grad() may do
    assert torch.equal(w.grad, torch.full_like(w, 7.0))
    assert_unchanged(snap)
    # still one graph: every replica's gradient reaches w (and so do detached ones not)
    loss = sum((r["w"].to("cpu") * (i + 1)).sum() for i, r in enumerate(replicas) if r["w"].is_cpu)
    (g,) = torch.autograd.grad(loss, w)
    cpu_ranks = [i + 1 for i, d in enumerate(devices) if d == "cpu"]
    assert torch.equal(g, torch.full_like(w, float(sum(cpu_ranks))))
    detached = fr.replicate(tree, devices, detach=True)
    assert all(not t.requires_grad for r in detached for t in tensor_leaves(r))
    assert not {id(t) for r in detached for t in tensor_leaves(r)} & set(objects)


def test_a_module_is_not_a_tree() -> None:
    lin = nn.Linear(2, 2)
    with pytest.raises(
        TypeError,
        match=r"^fr\.replicate: got a module \(Linear\), which is not a tree of tensors; "
        r"replicate its state instead: fr\.replicate\(fr\.state\(module\), devices\)$",
    ):
        fr.replicate(lin, ["cpu", "cpu"])  # type: ignore[type-var]
    with pytest.raises(TypeError, match=r"^fr\.replicate: got a module \(Sequential\)"):
        fr.replicate({"model": nn.Sequential(lin), "x": torch.ones(1)}, ["cpu"])


def test_torch_func_grad_with_a_meta_replica_in_the_tree() -> None:
    # replicas the loss does not use (here on meta) send no gradient back
    tree = {"a": torch.randn(3), "b": torch.randn(2)}

    def f(t: dict[str, torch.Tensor]) -> torch.Tensor:
        cpu, meta, cpu2 = fr.replicate(t, ["cpu", "meta", "cpu"])
        assert meta["a"].device == META
        return cpu["a"].sum() + (cpu2["a"] * 3).sum()

    g = torch.func.grad(f)(tree)
    assert torch.equal(g["a"], torch.full((3,), 4.0)) and torch.equal(g["b"], torch.zeros(2))


@pytest.mark.parametrize(
    "devices, match",
    [
        ([], r"^fr\.replicate: devices is empty; give at least one device$"),
        (["cpu", "gpu"], r"^fr\.replicate: devices\[1\] is not a device: 'gpu' \(expected e\.g\."),
        ([-1], r"^fr\.replicate: devices\[0\] is not a device: CUDA index -1 is negative$"),
        ("cpu", r"^fr\.replicate: devices must be a list of devices, got a single device 'cpu'"),
    ],
)
def test_bad_devices(devices: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fr.replicate({"a": torch.ones(1)}, devices)


@no_cuda
def test_cuda_without_cuda() -> None:
    with pytest.raises(
        ValueError, match=r"^fr\.replicate: devices\[1\] is 'cuda:0' but CUDA is not available"
    ):
        fr.replicate({"a": torch.ones(1)}, ["cpu", 0])


def test_sparse_leaf_needing_a_copy_names_its_path() -> None:
    t = torch.ones(2)
    sparse = torch.eye(3).to_sparse()
    tree = {"a": t, "b": 3, "c": t, "z": [torch.zeros(2), sparse]}
    with pytest.raises(
        TypeError,
        match=r"^fr\.replicate: the tensor at \['z'\]\[1\] has layout torch\.sparse_coo, which cannot be packed",
    ):
        fr.replicate(tree, ["cpu", "meta"])
    # on its own device it is shared, nothing to pack
    (same,) = fr.replicate(tree, ["cpu"])
    assert (
        same["z"][1] is not sparse
        and same["z"][1]._values().data_ptr() == sparse._values().data_ptr()
    )


def test_unmovable_leaf_names_its_path() -> None:
    tree = {
        "ok": torch.ones(1, device="meta"),
        "state": fr.State({"w": torch.ones(2, device="meta")}, {}),
    }
    with pytest.raises(
        TypeError,
        match=r"^fr\.replicate: cannot move the tensor\(s\) at \['ok'\], \['state'\]\.params\['w'\] from meta to cpu: ",
    ):
        fr.replicate(tree, ["cpu"])


@needs_cuda
def test_cuda_round_trip_and_gradients() -> None:
    g = torch.Generator().manual_seed(3)
    devices = ["cuda:0", "cpu", "cuda:0"]
    tree = {"a": torch.randn(3, 2, generator=g), "b": torch.randn(4, generator=g).double()}
    coeffs = [
        {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in tree.items()}
        for _ in devices
    ]
    leaves = {k: v.clone().requires_grad_() for k, v in tree.items()}
    replicas = fr.replicate(leaves, devices)
    assert replicas[0] is not replicas[2] and replicas[0]["a"] is replicas[2]["a"]
    assert replicas[1]["a"] is leaves["a"]
    for k, v in tree.items():
        assert replicas[0][k].device.type == "cuda" and torch.equal(replicas[0][k].cpu(), v)
    got = torch.autograd.grad(weighted(replicas, coeffs), list(leaves.values()))
    expected = torch.autograd.grad(
        weighted(oracle_copies(leaves, devices), coeffs), list(leaves.values())
    )
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    got_f = torch.func.grad(lambda t: weighted(fr.replicate(t, devices), coeffs))(tree)
    for (k, a), b in zip(got_f.items(), expected):
        torch.testing.assert_close(a, b, msg=k)
