"""Every private torch name freplicate uses, taken away in turn: its fallback is right, or says so.

``_torch.py`` looks each up once. On the pinned torch every one is there
(``FAST_PATHS``); a torch that moved one must get the same answers more
slowly, or a clear error at the point of use, never a silently different
result.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.func
import torch.utils.checkpoint as cp
from torch import nn

import freplicate as fr
from freplicate import _torch

torch.manual_seed(0)
MODEL = nn.Sequential(*[m for _ in range(5) for m in (nn.Linear(4, 4), nn.Tanh())])
X = torch.randn(3, 4)


def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
    return fr.apply(MODEL, fr.State(p, {}), X)[0].square().sum()


def reference() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return torch.func.grad_and_value(loss)(fr.state(MODEL).params)


def assert_same(got: tuple, want: tuple) -> None:
    fr.testing.assert_trees_close(got, want, rtol=0, atol=0)


def test_every_fast_path_is_on_with_the_pinned_torch() -> None:
    assert all(_torch.FAST_PATHS.values()), _torch.FAST_PATHS
    expected = {
        "maybe_current_level",
        "engine_run_backward",
        "storage_use_count",
        "foreach",
        "chunk_cat",
        "reentrant_checkpoint",
    }
    assert expected <= set(_torch.FAST_PATHS), _torch.FAST_PATHS


def test_without_the_engine_entry_autograd_grad_answers(monkeypatch) -> None:
    monkeypatch.setattr(_torch, "_run_backward", None)
    assert_same(fr.grad_and_value(loss)(fr.state(MODEL).params), reference())


def test_without_the_transform_level_torch_func_answers(monkeypatch) -> None:
    # a torch without the accessor: transform_level is the fallback, chosen at import, in every
    # module that calls it
    accessor = _torch.transform_level
    for name, module in list(sys.modules.items()):
        if name.startswith("freplicate") and getattr(module, "transform_level", None) is accessor:
            monkeypatch.setattr(module, "transform_level", _torch._any_level)
    assert _torch.transform_level() == -1  # "maybe in a transform": the transform-safe path
    assert_same(fr.grad_and_value(loss)(fr.state(MODEL).params), reference())


def test_without_storage_use_counts_pools_keep_nothing(monkeypatch) -> None:
    from freplicate._distributed._transport import Pool

    monkeypatch.setitem(_torch.FAST_PATHS, "storage_use_count", False)
    assert _torch.storage_use_count(torch.ones(1)) is None
    pool = Pool(4, torch.float32, torch.device("cpu"))
    a, b = pool.take(), pool.take()
    assert pool.entries == [] and a.data_ptr() != b.data_ptr()  # never a buffer twice


def test_without_foreach_kernels_the_loops_agree(monkeypatch) -> None:
    a = [torch.randn(3), torch.randn(2, 2)]
    b = [torch.randn(3), torch.randn(2, 2)]
    fused = (_torch.foreach_add(a, b, alpha=0.5), _torch.foreach_mul(a, 3.0))
    own = [t.clone() for t in a]
    _torch.foreach_add_(own, b, alpha=2.0)
    own2 = [t.clone() for t in a]
    _torch.foreach_div_(own2, 3.0)
    for name in ("_foreach_add", "_foreach_add_", "_foreach_mul", "_foreach_div_"):
        monkeypatch.setattr(_torch, name, None)
    looped2 = [t.clone() for t in a]
    _torch.foreach_div_(looped2, 3.0)
    assert_same(looped2, own2)
    assert_same((_torch.foreach_add(a, b, alpha=0.5), _torch.foreach_mul(a, 3.0)), fused)
    looped = [t.clone() for t in a]
    _torch.foreach_add_(looped, b, alpha=2.0)
    assert_same(looped, own)


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_without_chunk_cat_the_fallback_lays_rows_out_alike(monkeypatch, chunks) -> None:
    ts = [torch.randn(5, 3), torch.randn(2, 2, 2), torch.randn(1), torch.randn(7, 3).t(),
          torch.randn(3).expand(4, 3), torch.randn(0, 3)]
    width = sum(-(-t.shape[0] // chunks) * (t.numel() // max(t.shape[0], 1)) for t in ts)
    fast, slow = torch.empty(chunks, width), torch.empty(chunks, width)
    _torch.chunk_cat(ts, chunks, fast)
    monkeypatch.setattr(_torch, "_chunk_cat", None)
    _torch.chunk_cat(ts, chunks, slow)
    assert torch.equal(fast, slow)


class _Reentrant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(cp.checkpoint(self.a, torch.tanh(self.b.weight.sum() * x), use_reentrant=True))


def test_without_checkpoint_function_a_reentrant_graph_is_refused_by_name(monkeypatch) -> None:
    model = _Reentrant()
    params = fr.state(model).params

    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return fr.apply(model, fr.State(p, {}), X)[0].sum()

    fr.grad_and_value(f)(params)  # fine on the pinned torch
    monkeypatch.setattr(_torch, "_CheckpointFunction", None)
    with pytest.raises(RuntimeError, match=r"cannot tell whether the custom autograd Function .*CheckpointFunction"):
        fr.grad_and_value(f)(params)
    # a graph without custom Functions needs no answer
    assert_same(fr.grad_and_value(loss)(fr.state(MODEL).params), reference())


def test_without_the_functional_collectives_tracing_says_what_is_missing(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed._functional_collectives", None)
    with pytest.raises(RuntimeError, match=r"needs torch's functional collectives .* run the step eagerly"):
        _torch.functional_collectives()


def test_without_resolve_process_group_a_named_group_is_an_error(monkeypatch) -> None:
    from torch.distributed import distributed_c10d

    monkeypatch.delattr(distributed_c10d, "_resolve_process_group", raising=False)
    with pytest.raises(RuntimeError, match=r"cannot find process group 'other'"):
        _torch.resolve_group("other")


def test_the_constant_mark_is_what_dynamo_sets() -> None:
    # _torch.assume_constant_result sets the attribute itself, not to import Dynamo at import
    import torch._dynamo

    def f() -> int:
        return 1

    def g() -> int:
        return 1

    torch._dynamo.assume_constant_result(f)
    _torch.assume_constant_result(g)
    marked = {k for k, v in vars(f).items() if v is True}
    assert marked and marked == {k for k, v in vars(g).items() if v is True}


def test_without_graph_break_the_error_is_still_raised(monkeypatch) -> None:
    import torch._dynamo

    monkeypatch.delattr(torch._dynamo, "graph_break")
    _torch.graph_break("no break to make")  # returns: the caller raises its error itself


def test_without_torchs_clip_groups_a_single_group_clips_alike(monkeypatch) -> None:
    grads = {"a": torch.randn(3, 3), "b": torch.randn(4)}
    want = fr.clip_grad_norm(grads, 0.5)
    monkeypatch.setattr(_torch, "_group", None)
    monkeypatch.setattr(_torch, "_foreach_ok", None)
    monkeypatch.setattr(_torch, "_foreach_norm", None)
    assert_same(fr.clip_grad_norm(grads, 0.5), want)  # one (device, dtype): the same bits


def test_without_a_gradscaler_kernel_the_scaler_names_it(monkeypatch) -> None:
    with pytest.raises(RuntimeError, match=r"^fr\.GradScaler: this torch has no torch\.ops\.aten\.no_such_op"):
        _torch.aten_op("no_such_op", "fr.GradScaler")
