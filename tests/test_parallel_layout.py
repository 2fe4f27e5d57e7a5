"""Memory formats in one process: scatter, gather, all_reduce, data_parallel, data_parallel_grad.

Each result has the layout torch's own ops give it: a chunk's ``.to(device)``
(``nn.parallel.scatter``), ``torch.cat`` of the parts moved (``nn.parallel.gather``),
the sum of the replicas' tensors laid out as the first one (``ReduceAddCoalesced``
on tree 0's layout), and the per-replica deep copies that ``fr.testing``'s
oracle drives (``nn.DataParallel``'s steps, on CPU). Values are compared too,
bit for bit where both sides run the same ops.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import freplicate as fr

CL = torch.channels_last
META = torch.device("meta")


def size_one_free(t: torch.Tensor) -> tuple[int | None, ...]:
    """``t``'s strides, those of dims of size 1 (which address nothing) left out.

    torch's elementwise ops (``a + b``, the replicas' sum) lay a tensor whose
    ``is_contiguous()`` holds out contiguous, a dim of size 1 included: a
    depthwise conv weight ``(C, 1, k, k)`` in ``channels_last``, strides
    ``(9, 1, 3, 1)``, sums to ``(9, 9, 3, 1)``; a move or a packed sum keeps ``(9, 1, 3, 1)``.
    """
    return tuple(s if n != 1 else None for s, n in zip(t.stride(), t.shape))


def images(n: int = 6, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 5, 5, generator=g).to(memory_format=CL)


def batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "images": images(),
        "t": torch.randn(3, 6, generator=g).t(),  # rows of a column-major matrix
        "volume": torch.randn(6, 2, 2, 2, 3, generator=g).to(memory_format=torch.channels_last_3d),
        "tag": "x",
    }


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["meta", "cpu", "meta"]])
def test_scatter_chunks_have_the_strides_of_chunk_to_device(dim: int, devices: list[str]) -> None:
    tree = batch()
    before = {k: (v._version, v.clone()) for k, v in tree.items() if isinstance(v, torch.Tensor)}
    shards = fr.scatter(tree, devices, dim=dim)
    for k, (version, value) in before.items():
        assert tree[k]._version == version and torch.equal(tree[k], value)
    for k, t in tree.items():
        if not isinstance(t, torch.Tensor):
            continue
        want = [c.to(d) for c, d in zip(t.chunk(len(devices), dim), devices)]
        for i, (shard, chunk) in enumerate(zip(shards, want)):
            assert shard[k].stride() == chunk.stride(), (k, i)
            if chunk.device.type == "cpu":
                assert torch.equal(shard[k], chunk)
    if dim == 0:  # a batch of channels_last images cut by rows stays channels_last
        assert all(s["images"].is_contiguous(memory_format=CL) for s in shards)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_gather_has_the_strides_of_torch_cat(device: str) -> None:
    parts = [images(3, seed) for seed in range(3)]
    mixed = [parts[0], parts[1].contiguous(), parts[2]]
    transposed = [torch.randn(5, 2).t() for _ in range(3)]
    trees = [{"cl": a, "mixed": b, "t": c} for a, b, c in zip(parts, mixed, transposed)]
    out = fr.gather(trees, device)
    for k in ("cl", "mixed", "t"):
        want = torch.cat([tree[k].to(device) for tree in trees])
        assert out[k].stride() == want.stride(), k
        if device == "cpu":
            assert torch.equal(out[k], want)
    assert out["cl"].is_contiguous(memory_format=CL)
    back = fr.gather(fr.scatter({"x": images()}, ["cpu", "meta", "cpu"]), "meta")
    assert back["x"].stride() == images().stride()


def reduce_trees(requires_grad: bool) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randint(-8, 9, shape, generator=g).float()  # sums and means exact

    trees = []
    for r in range(3):
        tree = {
            "conv": draw(4, 3, 2, 3).to(memory_format=CL),
            "depthwise": draw(4, 1, 3, 3).to(memory_format=CL),
            "linear_t": draw(7, 5).t(),
            "bias": draw(3),
        }
        if r == 1:  # another layout of the same values: the sums follow tree 0's
            tree = {k: v.contiguous() for k, v in tree.items()}
        if requires_grad:
            tree = {k: v.detach().requires_grad_() for k, v in tree.items()}
        trees.append(tree)
    return trees


@pytest.mark.parametrize("requires_grad", [False, True], ids=["foreach", "packed"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_all_reduce_results_have_tree_0s_strides_and_are_aligned(
    requires_grad: bool, op: str
) -> None:
    trees = reduce_trees(requires_grad)
    results = fr.all_reduce(trees, op=op)
    for k, t in trees[0].items():
        total = sum(tree[k].detach() for tree in trees)
        want = total / 3 if op == "mean" else total
        for result in results:
            assert torch.equal(result[k], want), k
            assert result[k].data_ptr() % 64 == 0, k
            if requires_grad:  # packed in tree 0's layout: its strides
                assert result[k].stride() == t.stride(), k
            else:  # torch's sum of the trees' tensors
                assert result[k].stride() == want.stride(), k
                assert size_one_free(result[k]) == size_one_free(t), k
    # on another device (meta: shapes and strides, no data), the same layout
    on_meta = [{k: v.to(META) for k, v in tree.items()} for tree in trees]
    for result, here in zip(fr.all_reduce(on_meta, op=op), results):
        # (meta's sum keeps a dim of size 1's stride, where the CPU's lays it out anew)
        assert {k: size_one_free(v) for k, v in result.items()} == {
            k: size_one_free(v) for k, v in here.items()
        }


def test_all_reduce_gradients_keep_strides_and_values() -> None:
    trees = reduce_trees(True)
    results = fr.all_reduce(trees, op="mean")
    g = torch.Generator().manual_seed(3)
    weights = {k: torch.randn(v.shape, generator=g) for k, v in trees[0].items()}
    loss = sum((r[k] * weights[k]).sum() for r in results for k in r)
    for i, tree in enumerate(trees):
        grads = torch.autograd.grad(loss, list(tree.values()), retain_graph=True)
        for (k, t), grad in zip(tree.items(), grads):
            torch.testing.assert_close(grad, weights[k])  # 3 results, each 1 / 3 of every tree
            if i != 1:  # tree 1's leaves are contiguous: it was packed in tree 0's layout
                assert grad.stride() == t.stride(), (i, k)


def test_compiled_all_reduce_keeps_strides() -> None:
    """The packed path while Dynamo traces (the sum is then always packed): tree 0's strides."""
    trees = reduce_trees(False)
    torch._dynamo.reset()
    compiled = torch.compile(lambda ts: fr.all_reduce(ts, op="sum"), backend="aot_eager")
    got, want = compiled(trees), fr.all_reduce(trees, op="sum")
    for g, w in zip(got, want):
        for k, t in trees[0].items():
            assert torch.equal(g[k], w[k]) and g[k].stride() == t.stride(), k


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.depthwise = nn.Conv2d(4, 4, 3, groups=4)
        self.head = nn.Linear(4 * 3 * 3, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.depthwise(F.relu(self.bn(self.conv(x))))
        return {"features": y, "logits": self.head(y.flatten(1))}


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return ConvNet().to(memory_format=CL)


def by_hand(model: nn.Module, x: torch.Tensor, devices: list[str]) -> tuple[Any, Any, Any]:
    """nn.DataParallel's steps on CPU: a deep copy per shard, forward, gather, backward."""
    replicas = [copy.deepcopy(model) for _ in devices]
    outs = [r(c) for r, c in zip(replicas, x.chunk(len(devices)))]
    out = {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
    loss(out).backward()
    grads = {
        k: sum(dict(r.named_parameters())[k].grad for r in replicas)
        for k, _ in model.named_parameters()
    }
    return out, grads, dict(replicas[0].named_buffers())


def loss(out: dict[str, torch.Tensor]) -> torch.Tensor:
    g = torch.Generator().manual_seed(4)
    return sum((v * torch.randn(v.shape, generator=g)).sum() for v in out.values())  # type: ignore[return-value]


def test_data_parallel_keeps_formats_beside_per_replica_deep_copies() -> None:
    model, x, devices = conv_net(), images(), ["cpu", "cpu"]
    fr.testing.check_against_stateful(model, (x,), devices)
    state = fr.state(model)
    params = {k: v.detach().requires_grad_() for k, v in state.params.items()}
    out, new = fr.data_parallel(model, fr.State(params, state.buffers), x, devices=devices)
    grads = dict(zip(params, torch.autograd.grad(loss(out), list(params.values()))))
    want_out, want_grads, want_buffers = by_hand(model, x, devices)
    for k, v in want_out.items():
        assert torch.equal(out[k], v) and out[k].stride() == v.stride(), k
    for k, v in want_grads.items():
        assert torch.equal(grads[k], v), k
        assert size_one_free(grads[k]) == size_one_free(v) == size_one_free(params[k]), k
    for k, v in want_buffers.items():
        assert torch.equal(new.buffers[k], v) and new.buffers[k].stride() == v.stride(), k


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_data_parallel_grad_gradients_have_the_parameters_strides(devices: list[str]) -> None:
    model = conv_net().eval()
    state = fr.state(model)

    def loss_fn(params: Any, x: torch.Tensor) -> torch.Tensor:
        out, _ = fr.apply(model, fr.State(params, state.buffers), x)
        return out["logits"].square().mean()

    x = images()
    grads, value = fr.data_parallel_grad(loss_fn, devices)(state.params, x)
    want, want_value = torch.func.grad_and_value(loss_fn)(state.params, x)
    torch.testing.assert_close(value, want_value)
    for k, p in state.params.items():
        torch.testing.assert_close(grads[k], want[k], rtol=1e-5, atol=1e-6)
        assert size_one_free(grads[k]) == size_one_free(p), k
        if len(devices) == 1:  # the replica's own gradient, as autograd laid it out
            assert grads[k].stride() == p.stride(), k
    assert state.params["conv.weight"].is_contiguous(memory_format=CL)
