"""The coalescing engine: layouts, buckets, pack/unpack round trips, moves, broadcast, reduce."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from freplicate import _pack

CPU, META = torch.device("cpu"), torch.device("meta")
DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.bool, torch.complex64]


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g, dtype=dtype)


SHAPES = [(), (0,), (3, 4), (2, 0, 5), (1,), (2, 3, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack_round_trip(dtype: torch.dtype) -> None:
    ts = [sample(dtype, s, i) for i, s in enumerate(SHAPES)]
    before = [t.clone() for t in ts]
    layout = _pack.layout_of(ts)
    numels = (1, 0, 12, 0, 1, 12)
    step = 64 // dtype.itemsize  # every tensor starts 64-byte aligned: pads to the next
    pads = (*(-n % step for n in numels[:-1]), 0)
    shapes = tuple(torch.Size(s) for s in SHAPES)
    assert layout == (shapes, numels, dtype, CPU, (None,) * 6, pads)
    flat = _pack.pack(ts)
    assert flat.shape == (layout.size,) == (sum(numels) + sum(pads),) and flat.dtype == dtype
    back = _pack.unpack(flat, layout)
    offsets = [sum(numels[:i]) + sum(pads[:i]) for i in range(len(ts))]
    for b, t, orig, offset in zip(back, ts, before, offsets):
        assert b.shape == t.shape and b.dtype == dtype and b.stride() == t.stride()
        assert torch.equal(b, t)
        assert torch.equal(t, orig) and t._version == 0  # inputs untouched
        assert b.storage_offset() == offset and (offset * dtype.itemsize) % 64 == 0
        if b.numel():
            assert b.data_ptr() % 64 == 0  # a fresh buffer starts aligned, so does each view
    # the views share the flat buffer: one storage, no per-leaf copies
    assert all(b.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for b in back)
    assert not flat[offsets[0] + 1 : offsets[2]].any()  # the padding is zeros


def test_pack_of_one_tensor_is_a_view_not_a_copy() -> None:
    t = torch.arange(6.0).view(2, 3)
    flat = _pack.pack([t])
    assert flat.data_ptr() == t.data_ptr() and flat.shape == (6,)
    (back,) = _pack.unpack(flat, _pack.layout_of([t]))
    assert back.shape == (2, 3) and torch.equal(back, t)


def test_pack_non_contiguous() -> None:
    t = torch.arange(6.0).view(2, 3).t()
    flat = _pack.pack([t, torch.ones(1)])
    # in its memory order, then padding to 64 bytes
    assert flat.tolist() == [0, 1, 2, 3, 4, 5] + [0] * 10 + [1]
    (back, _) = _pack.unpack(flat, _pack.layout_of([t, torch.ones(1)]))
    assert torch.equal(back, t) and back.stride() == t.stride()


def test_group_by_first_seen_order() -> None:
    ts = [
        torch.ones(1, dtype=torch.int64),
        torch.ones(1),
        torch.ones(1, device="meta"),
        torch.ones(2),
        torch.ones(1, dtype=torch.int64),
    ]
    assert _pack.group_by(ts, _pack.device_dtype) == {
        (CPU, torch.int64): [0, 4],
        (CPU, torch.float32): [1, 3],
        (META, torch.float32): [2],
    }
    assert _pack.group_by([], _pack.device_dtype) == {}


def test_check_packable_names_the_path() -> None:
    dense, sparse = torch.ones(2), torch.eye(2).to_sparse()
    _pack.check_packable([dense], [0], ["['a']"], caller="fr.x")
    with pytest.raises(
        TypeError,
        match=r"^fr\.x: the tensor at \['s'\] has layout torch\.sparse_coo, which cannot be packed"
        r" into a flat buffer; convert it \(e\.g\. \.to_dense\(\)\)",
    ):
        _pack.check_packable([dense, sparse], [0, 2], ["['a']", "['b']", "['s']"], caller="fr.x")


def test_move_failure_names_the_leaves() -> None:
    flat = torch.ones(4, device="meta")
    paths = ["['a']", "['b']", "['c']", "['d']", "['e']"]
    with pytest.raises(
        TypeError,
        match=r"^f: cannot move the tensor\(s\) at \['b'\], \['c'\], \['d'\], \.\.\. from meta to cpu: ",
    ):
        _pack.move(flat, CPU, [1, 2, 3, 4], paths, caller="f")
    with pytest.raises(
        TypeError, match=r"^f: cannot move the tensor\(s\) at \['e'\] from meta to cpu"
    ):
        _pack.move(flat, CPU, [4], paths, caller="f")


def test_broadcast_coalesced_shares_same_device_and_copies_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    moves: list[tuple[torch.dtype, int]] = []
    real_move = _pack.move

    def counting_move(flat: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        moves.append((flat.dtype, flat.numel()))
        return real_move(flat, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_pack, "move", counting_move)
    ts = [torch.ones(2, 3), torch.arange(4), torch.zeros(()), torch.ones(0)]
    out = _pack.broadcast_coalesced(ts, [CPU, META, META, CPU], paths=[], caller="f")
    # one flat buffer per (source device, dtype), moved once per distinct target device
    # (the float32 one: 6 + 1 + 0 elements, each but the last padded to 16: 64 bytes)
    assert sorted(moves, key=str) == [(torch.float32, 32), (torch.int64, 4)]
    assert all(a is b for a, b in zip(out[0], ts)) and all(a is b for a, b in zip(out[3], ts))
    assert out[1] is out[2]  # a repeated target device reuses the same views
    for moved, t in zip(out[1], ts):
        assert moved.device == META and moved.shape == t.shape and moved.dtype == t.dtype


def test_broadcast_detach() -> None:
    w = torch.ones(3, requires_grad=True)
    (same,), (moved,) = _pack.broadcast_coalesced(
        [w], [CPU, META], paths=["w"], caller="f", detach=True
    )
    assert not same.requires_grad and same.data_ptr() == w.data_ptr()
    assert not moved.requires_grad and moved.grad_fn is None
    (same,), (moved,) = _pack.broadcast_coalesced([w], [CPU, META], paths=["w"], caller="f")
    assert same is w and moved.grad_fn is not None


def round_trip(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The engine's copy path (pack, move, unpack), here onto the CPU it came from."""
    return _pack.unpack(_pack.move(_pack.pack(ts), CPU, [], [], caller="f"), _pack.layout_of(ts))


def test_engine_is_differentiable_under_autograd_and_torch_func() -> None:
    a, b = torch.randn(2, 3), torch.randn(4)
    ca, cb = torch.randn(2, 3), torch.randn(4)

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        u, v = round_trip([x, y])
        return (u * ca).sum() + (v * cb).sum() + (u**2).sum()

    ga, gb = torch.func.grad(loss, argnums=(0, 1))(a, b)
    assert torch.allclose(ga, ca + 2 * a) and torch.equal(gb, cb)
    ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
    assert all(
        torch.allclose(x, y) for x, y in zip(torch.autograd.grad(loss(ar, br), (ar, br)), (ga, gb))
    )
    _, vjp = torch.func.vjp(lambda x, y: tuple(round_trip([x, y])), a, b)
    va, vb = vjp((ca, cb))
    assert torch.equal(va, ca) and torch.equal(vb, cb)


def test_reduce_add_coalesced() -> None:
    lists = [
        [torch.full((2, 2), float(k)), torch.tensor(k), torch.arange(3) * k] for k in (1, 2, 3)
    ]
    before = [[t.clone() for t in lst] for lst in lists]
    out = _pack.reduce_add_coalesced(lists, CPU, paths=["a", "b", "c"], caller="f")
    assert torch.equal(out[0], torch.full((2, 2), 6.0))
    assert torch.equal(out[1], torch.tensor(6)) and out[1].dtype == torch.int64
    assert torch.equal(out[2], torch.arange(3) * 6)
    for lst, orig in zip(lists, before):
        assert all(torch.equal(t, o) and t._version == 0 for t, o in zip(lst, orig))


def test_reduce_add_of_one_list_never_returns_the_callers_tensor() -> None:
    t = torch.ones(3)
    (alone,) = _pack.reduce_add_coalesced([[t]], CPU, paths=["t"], caller="f")
    assert alone is not t and alone.data_ptr() != t.data_ptr() and torch.equal(alone, t)
    u = torch.zeros(2)
    pair = _pack.reduce_add_coalesced([[t, u]], CPU, paths=["t", "u"], caller="f")
    assert all(r.data_ptr() != x.data_ptr() for r, x in zip(pair, (t, u)))


def test_reduce_add_is_differentiable() -> None:
    xs = [torch.randn(3, requires_grad=True) for _ in range(3)]
    (total,) = _pack.reduce_add_coalesced([[x] for x in xs], CPU, paths=["x"], caller="f")
    c = torch.randn(3)
    grads = torch.autograd.grad((total * c).sum(), xs)
    assert all(torch.equal(g, c) for g in grads)


def test_reduce_add_onto_meta_and_sparse_error() -> None:
    out = _pack.reduce_add_coalesced(
        [[torch.ones(2)], [torch.ones(2)]], META, paths=["x"], caller="f"
    )
    assert out[0].device == META and out[0].shape == (2,)
    sparse = torch.eye(2).to_sparse()
    with pytest.raises(TypeError, match=r"^fr\.all_reduce: the tensor at \['s'\] has layout"):
        _pack.reduce_add_coalesced(
            [[sparse], [sparse]], CPU, paths=["['s']"], caller="fr.all_reduce"
        )


def test_move_each_coalesces_per_target_and_keeps_what_is_there() -> None:
    a, b, c = torch.ones(2), torch.arange(3.0), torch.zeros(1, dtype=torch.int64)
    out = _pack.move_each([a, b, c], [CPU, META, META], paths=["a", "b", "c"], caller="f")
    assert out[0] is a
    assert [t.device for t in out] == [CPU, META, META]
    assert [t.shape for t in out] == [a.shape, b.shape, c.shape]


class _NoMemory(torch.Tensor):
    def to(self, *args: object, **kwargs: object) -> torch.Tensor:  # type: ignore[override]
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_move_out_of_memory_is_not_a_type_error() -> None:
    flat = torch.ones(3).as_subclass(_NoMemory)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        _pack.move(flat, META, [0], ["['w']"], caller="fr.replicate")


def test_pool_keeps_one_spare_beyond_live_results() -> None:
    from freplicate._distributed._transport import Pool

    pool = Pool(4, torch.float32, torch.device("cpu"))
    a = pool.take()
    held = a[:2]  # a is busy
    b = pool.take()
    held_b = b[:2]  # b busy too
    assert len(pool.entries) == 2 and a.data_ptr() != b.data_ptr()
    del held, held_b, a, b  # both spare now
    pool.take()
    assert len(pool.entries) == 1  # the second spare was let go


# --- memory order and alignment ----------------------------------------------------------


def formats(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    """Dense tensors of several memory orders, non-dense ones, and odd sizes (padding needed)."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return sample(dtype, shape, int(torch.randint(0, 2**16, (), generator=g)))

    return [
        draw(3),
        draw(5, 3, 2, 3).to(memory_format=torch.channels_last),
        draw(7, 5).t(),
        draw(3, 2, 2, 3, 2).to(memory_format=torch.channels_last_3d),
        draw(4, 1, 3, 3).to(memory_format=torch.channels_last),  # depthwise: a dim of size 1
        draw(2, 3, 4).permute(2, 0, 1),
        draw(5, 4, 3, 3).to(memory_format=torch.channels_last)[:, 1:3],  # not dense
        draw(6, 5).t()[::2],  # not dense
        draw(3, 1).expand(3, 4),  # stride 0
        draw(),
        draw(0, 3),
    ]


def test_memory_order_is_torchs() -> None:
    """The dims in the order ``.to()`` and ``clone()`` keep (``empty_like``'s rule): the views
    come back with the strides of ``t.to(device)``, dense or not."""
    for t in formats():
        moved = _pack.broadcast_coalesced([torch.ones(1), t], [META], paths="ab", caller="f")[0][1]
        assert moved.stride() == t.to(META).stride() == t.clone().stride(), tuple(t.shape)
    assert _pack.memory_order(torch.ones(2, 3)) is None
    assert _pack.memory_order(torch.ones(2, 1, 3)) is None  # a natural size-1 stride
    assert _pack.memory_order(torch.ones(1, 2, 3, 3).to(memory_format=torch.channels_last)) == (
        0,
        2,
        3,
        1,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_views_keep_strides_and_start_64_byte_aligned(dtype: torch.dtype) -> None:
    ts = formats(dtype, seed=1)
    before = [(t.clone(), t._version) for t in ts]
    layout = _pack.layout_of(ts)
    flat = _pack.pack(ts, layout).clone()  # a buffer of its own, as a move or a sum makes
    assert flat.data_ptr() % 64 == 0 and flat.shape == (layout.size,)
    for t, v in zip(ts, _pack.unpack(flat, layout)):
        assert torch.equal(v, t) and v.dtype == dtype
        assert v.stride() == t.clone().stride()  # the input's, where it is dense
        assert (v.storage_offset() * dtype.itemsize) % 64 == 0
        if v.numel():
            assert v.data_ptr() % 64 == 0
    for t, (orig, version) in zip(ts, before):
        assert torch.equal(t, orig) and t._version == version


def test_one_tensor_in_its_memory_order_packs_as_a_view() -> None:
    t = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    flat = _pack.pack([t])
    assert flat.data_ptr() == t.data_ptr() and flat.shape == (120,)
    (back,) = _pack.unpack(flat, _pack.layout_of([t]))
    assert back.stride() == t.stride() and torch.equal(back, t)


def test_a_layout_given_lays_other_tensors_out_in_its_orders() -> None:
    """A reduction packs every list in the first one's orders: equal places, equal elements."""
    first = [torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), torch.randn(4, 3).t()]
    other = [t.contiguous() + 1 for t in first]
    layout = _pack.layout_of(first)
    a, b = _pack.pack(first, layout), _pack.pack(other, layout)
    sums = _pack.unpack(a + b, layout)
    for s, x, y in zip(sums, first, other):
        assert torch.equal(s, x + y) and s.stride() == x.stride()


def sum_lists(requires_grad: bool, device: torch.device = CPU) -> tuple[Any, list[Any]]:
    g = torch.Generator().manual_seed(3)
    base = [
        torch.randn(2, 3, 4, 5, generator=g),
        torch.randn(7, 5, generator=g),
        torch.randn(3, generator=g),
    ]
    # list 0 channels_last / transposed; list 1 contiguous; list 2 channels_last again
    lists = [
        [base[0].to(memory_format=torch.channels_last), base[1].t().contiguous().t(), base[2]],
        [(b * 2).contiguous() for b in base],
        [(base[0] * 3).to(memory_format=torch.channels_last), base[1] * 3, base[2] * 3],
    ]
    if requires_grad:
        lists = [[t.detach().requires_grad_() for t in lst] for lst in lists]
    out = _pack.reduce_add_coalesced(lists, device, paths=["a", "b", "c"], caller="f")
    return out, lists


@pytest.mark.parametrize("requires_grad", [False, True], ids=["foreach", "packed"])
def test_reduce_add_keeps_the_first_lists_strides(requires_grad: bool) -> None:
    out, lists = sum_lists(requires_grad)
    for k, s in enumerate(out):
        want = lists[0][k] + lists[1][k] + lists[2][k]
        torch.testing.assert_close(s, want, rtol=0, atol=0)
        assert s.stride() == lists[0][k].stride()
        assert s.data_ptr() % 64 == 0
    meta, lists = sum_lists(requires_grad, META)
    assert [m.stride() for m in meta] == [t.stride() for t in lists[0]]


def test_a_list_on_another_device_is_padded_there() -> None:
    """Every list is laid out as the first one, padding included, on its own device."""
    here = [torch.ones(3), torch.ones(2, 3).t()]
    there = [t.to(META) for t in here]
    for lists in ([here, there], [there, here]):
        out = _pack.reduce_add_coalesced(lists, META, paths=["a", "b"], caller="f")
        assert [t.stride() for t in out] == [(1,), (1, 3)]
        assert all(t.device == META for t in out)


def test_broadcast_and_move_keep_strides() -> None:
    ts = formats()
    for moved in _pack.broadcast_coalesced(ts, [META, META], paths="abcdefghijk", caller="f"):
        assert [m.stride() for m in moved] == [t.to(META).stride() for t in ts]
    moved = _pack.move_each(ts, [META] * len(ts), paths="abcdefghijk", caller="f")
    assert [m.stride() for m in moved] == [t.to(META).stride() for t in ts]


def test_engine_with_orders_and_padding_composes_with_every_transform() -> None:
    """Autograd (twice), torch.func grad / vjp / jvp / vmap through pack, move and unpack of
    tensors in several memory orders, padded to 64 bytes."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(2, 3, 2, 3, generator=g).to(memory_format=torch.channels_last)
    b = torch.randn(5, 3, generator=g).t()
    c = torch.randn(3, generator=g)
    ca, cb, cc = (torch.randn(t.shape, generator=g) for t in (a, b, c))

    def loss(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        u, v, w = round_trip([x, y, z])
        assert u.stride() == x.stride() and v.stride() == y.stride()
        return (u * ca).sum() + (v * cb).sum() + (w**3 * cc).sum()

    grads = torch.func.grad(loss, argnums=(0, 1, 2))(a, b, c)
    want = (ca, cb, 3 * c**2 * cc)
    assert all(torch.allclose(x, y) for x, y in zip(grads, want))
    leaves = [t.detach().requires_grad_() for t in (a, b, c)]
    first = torch.autograd.grad(loss(*leaves), leaves, create_graph=True)
    assert all(torch.allclose(x, y) for x, y in zip(first, want))
    (second,) = torch.autograd.grad(first[2].sum(), leaves[2])  # double backward
    assert torch.allclose(second, 6 * c * cc)
    _, vjp = torch.func.vjp(lambda *xs: tuple(round_trip(list(xs))), a, b, c)
    assert all(torch.equal(x, y) for x, y in zip(vjp((ca, cb, cc)), (ca, cb, cc)))
    out, tangents = torch.func.jvp(lambda *xs: tuple(round_trip(list(xs))), (a, b, c), (ca, cb, cc))
    assert all(torch.equal(x, y) for x, y in zip(out + tangents, (a, b, c, ca, cb, cc)))
    d = torch.randn(2, 5, 3, generator=g).transpose(1, 2)
    batched = torch.func.vmap(lambda x, y: tuple(round_trip([x, y])))(a, d)
    assert torch.equal(batched[0], a) and torch.equal(batched[1], d)
