"""``fr.GradScaler`` against ``torch.amp.GradScaler``: the scales, the skipped steps, the parameters.

One process: GradScaler + ``torch.optim.SGD`` (+ ``clip_grad_norm_`` after
``unscale_``) with fp16 autocast on CPU, from a huge first scale (overflows
until it has backed off), with growth after ``growth_interval``; eager and
compiled. Two gloo ranks against GradScaler + DDP: ``tests/_amp_workers.py``.
"""

from __future__ import annotations

import copy
import io
import itertools
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import freplicate as fr

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the workers by name
import _amp_workers as aw
import _dist_workers as w

OPTIONS = {"init_scale": 2.0**24, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3}
LR, MAX_NORM, STEPS = 0.1, 1.0, 25


def model_and_data() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
        for _ in range(STEPS)
    ]
    return model, data


def torch_run(model: nn.Module, data: list[Any]) -> list[dict[str, Any]]:
    """GradScaler's documented loop with clipping: scale, backward, unscale_, clip, step, update."""
    scaler = torch.amp.GradScaler("cpu", **OPTIONS)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
        out.append(
            {
                "params": {k: p.detach().clone() for k, p in model.named_parameters()},
                "scale": scaler.get_scale(),
                "tracker": scaler._get_growth_tracker(),
                "loss": loss.detach(),
                "norm": norm,
            }
        )
    return out


def fr_step(model: nn.Module, scaler: fr.GradScaler) -> Any:
    def loss_fn(params: Any, amp: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        with torch.autocast("cpu", dtype=torch.float16):
            out, _ = fr.apply(model, fr.State(params, {}), x)
            loss = F.cross_entropy(out, y)
        return scaler.scale(amp, loss), loss

    grad = fr.grad_and_value(loss_fn, has_aux=True)

    def step(params: Any, amp: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        grads, (_, loss) = grad(params, amp, x, y)
        grads, found_inf = scaler.unscale(amp, grads)
        grads, norm = fr.clip_grad_norm(grads, MAX_NORM)
        updated = {k: p.add(grads[k], alpha=-LR) for k, p in params.items()}  # SGD's add_
        return scaler.step(found_inf, updated, params), scaler.update(amp, found_inf), loss, norm

    return step


def fr_run(
    model: nn.Module, data: list[Any], step: Any, scaler: fr.GradScaler
) -> list[dict[str, Any]]:
    params, amp = dict(fr.state(model).params), scaler.init()
    out = []
    for x, y in data:
        params, amp, loss, norm = step(params, amp, x, y)
        out.append(
            {
                "params": params,
                "scale": float(amp["scale"]),
                "tracker": int(amp["growth_tracker"]),
                "loss": loss,
                "norm": norm,
            }
        )
    return out


def assert_same_runs(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a["scale"], a["tracker"]) == (b["scale"], b["tracker"]), i
        assert torch.equal(a["loss"], b["loss"]), i
        assert torch.equal(a["norm"], b["norm"]) or (a["norm"].isnan() and b["norm"].isnan()), i
        for k in b["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), (i, k)


def test_equals_grad_scaler_step_for_step_through_overflows_and_growth():
    model, data = model_and_data()
    want = torch_run(copy.deepcopy(model), data)
    scales = [r["scale"] for r in want]
    # the run exercises every branch: overflows (backoff, skipped), clean steps, growth
    assert scales[0] == OPTIONS["init_scale"] / 2 and any(
        b > a for a, b in itertools.pairwise(scales)
    )
    skipped = [i for i, r in enumerate(want) if r["norm"].isinf() or r["norm"].isnan()]
    assert len(skipped) >= 5 and len(skipped) < STEPS - 5
    scaler = fr.GradScaler(**OPTIONS)
    assert_same_runs(fr_run(model, data, fr_step(model, scaler), scaler), want)


def test_compiled_step_is_one_graph_equal_to_eager():
    model, data = model_and_data()
    scaler = fr.GradScaler(**OPTIONS)
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fr_step(model, scaler), backend=backend, fullgraph=True)
    got = fr_run(model, data, compiled, scaler)
    assert len(graphs) == 1  # no host read, no recompile when the scale or the flag changes
    assert_same_runs(got, fr_run(model, data, fr_step(model, scaler), scaler))


def test_nothing_is_modified_and_the_state_loads_with_weights_only():
    scaler = fr.GradScaler(init_scale=4.0, growth_interval=1)
    amp = scaler.init()
    grads = {"w": torch.tensor([8.0, 4.0]), "b": torch.tensor([float("nan")])}
    versions = [t._version for t in (*amp.values(), *grads.values())]
    out, found = scaler.unscale(amp, grads)
    new = scaler.update(amp, found)
    assert [t._version for t in (*amp.values(), *grads.values())] == versions
    assert float(amp["scale"]) == 4.0 and int(amp["growth_tracker"]) == 0
    assert torch.equal(grads["w"], torch.tensor([8.0, 4.0])) and out["w"] is not grads["w"]
    buf = io.BytesIO()
    torch.save(new, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert set(loaded) == {"scale", "growth_tracker"}
    assert torch.equal(loaded["scale"], torch.tensor(2.0))
    assert loaded["growth_tracker"].dtype == torch.int32


def torch_unscale(
    grads: dict[str, torch.Tensor], init_scale: float
) -> tuple[dict[str, Any], float]:
    """GradScaler.unscale_ on parameters with these gradients; and the scale its update() leaves."""
    params = {}
    for k, g in grads.items():
        params[k] = p = nn.Parameter(torch.zeros(g.shape, dtype=g.dtype))
        p.grad = g.clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    opt = torch.optim.SGD(params.values(), lr=0.0)
    scaler.scale(torch.ones(()))  # GradScaler makes its scale on first use
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return {k: p.grad for k, p in params.items()}, scaler.get_scale()


@pytest.mark.parametrize("bad", [None, "bf16", "f64", "sparse"])
def test_unscale_of_mixed_dtypes_and_sparse_as_grad_scaler(bad: str | None):
    g = torch.Generator().manual_seed(0)
    grads = {
        "w": torch.randn(3, 4, generator=g) * 1000,
        "h": (torch.randn(5, generator=g) * 1000).to(torch.bfloat16),
        "d": torch.randn(2, generator=g, dtype=torch.float64),
        "e": torch.sparse_coo_tensor([[0, 2]], torch.randn(2, 3, generator=g), (4, 3)),
    }
    if bad == "bf16":
        grads["h"][1] = float("inf")
    if bad == "f64":
        grads["d"][0] = float("nan")
    if bad == "sparse":
        grads["e"] = torch.sparse_coo_tensor(
            [[1]], torch.tensor([[1.0, float("inf"), 0.0]]), (4, 3)
        )
    init_scale = 3.0  # not a power of 2: the reciprocal rounds
    want, want_scale = torch_unscale(grads, init_scale)
    scaler = fr.GradScaler(init_scale=init_scale)
    amp = scaler.init()
    got, found = scaler.unscale(amp, grads)
    assert bool(found) == (bad is not None)
    assert float(scaler.update(amp, found)["scale"]) == want_scale
    for k in grads:
        a, b = (got[k].to_dense(), want[k].to_dense()) if grads[k].is_sparse else (got[k], want[k])
        assert a.dtype == b.dtype and torch.equal(a.nan_to_num(), b.nan_to_num()), k


def test_a_scale_that_would_overflow_float32_does_not_grow():
    scaler = fr.GradScaler(init_scale=2.0**127, growth_interval=1)
    amp = scaler.update(scaler.init(), torch.tensor(0.0))
    assert float(amp["scale"]) == 2.0**127 and int(amp["growth_tracker"]) == 0


def test_found_inf_of_several_optimizers_adds_up():
    scaler = fr.GradScaler(init_scale=8.0)
    amp = scaler.init()
    _, a = scaler.unscale(amp, {"w": torch.tensor([1.0])})
    _, b = scaler.unscale(amp, {"v": torch.tensor([math.inf])})
    assert float(scaler.update(amp, a + b)["scale"]) == 4.0


def test_across_ranks_without_a_process_group_is_the_local_flag():
    scaler = fr.GradScaler(init_scale=2.0)
    amp = scaler.init()
    for g, want in ((torch.tensor([1.0]), 0.0), (torch.tensor([math.nan]), 1.0)):
        _, found = scaler.unscale(amp, {"w": g}, across_ranks=True)
        assert float(found) == want


def test_scale_and_step_on_trees():
    scaler = fr.GradScaler(init_scale=2.0)
    amp = scaler.init()
    assert scaler.scale(amp, {"a": torch.tensor(3.0), "n": 1}) == {"a": torch.tensor(6.0), "n": 1}
    new = {"w": torch.tensor([2.0, math.nan]), "state": (torch.tensor(5), "tag")}
    old = {"w": torch.tensor([1.0, 1.0]), "state": (torch.tensor(4), "tag")}
    kept = scaler.step(torch.tensor(2.0), new, old)
    assert torch.equal(kept["w"], old["w"]) and torch.equal(kept["state"][0], torch.tensor(4))
    taken = scaler.step(torch.tensor(0.0), new, old)
    assert taken["w"][0] == 2.0 and taken["w"][1].isnan() and taken["state"][1] == "tag"


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda s, a: s.unscale(a, {"w": torch.ones(2, dtype=torch.float16)}),
            TypeError,
            r"fr.GradScaler.unscale: the gradient at \['w'\] is float16, which GradScaler refuses",
        ),
        (
            lambda s, a: s.unscale(a, {"n": [torch.ones(2, dtype=torch.int64)]}),
            TypeError,
            r"fr.GradScaler.unscale: the gradient at \['n'\]\[0\] is torch.int64",
        ),
        (
            lambda s, a: s.update({"scale": 1.0}, torch.tensor(0.0)),
            TypeError,
            r"fr.GradScaler.update: state must be the dict of tensors that init\(\) returns",
        ),
        (
            lambda s, a: s.step(torch.tensor(0.0), {"w": torch.ones(1)}, {"v": torch.ones(1)}),
            ValueError,
            r"fr.GradScaler.step: updated and current differ at the root",
        ),
        (lambda s, a: fr.GradScaler(growth_factor=1.0), ValueError, "growth_factor must be > 1.0"),
        (
            lambda s, a: fr.GradScaler(backoff_factor=1.0),
            ValueError,
            r"backoff_factor must be in \(0, 1\)",
        ),
        (
            lambda s, a: fr.GradScaler(growth_interval=0),
            ValueError,
            "growth_interval must be an int >= 1",
        ),
        (
            lambda s, a: fr.GradScaler(init_scale=math.inf),
            ValueError,
            "init_scale must be a finite positive",
        ),
        (lambda s, a: fr.GradScaler(init_scale="1"), TypeError, "init_scale must be a number"),
    ],
)
def test_errors_name_the_method_and_the_path(call: Any, error: type, match: str):
    scaler = fr.GradScaler()
    with pytest.raises(error, match=match):
        call(scaler, scaler.init())


# --- two ranks: against GradScaler + DDP -------------------------------------------------


@pytest.fixture(scope="module")
def job() -> dict[str, list[Any]]:
    return aw.run(["scaler_against_ddp"], pg_timeout=30.0, deadline=240.0)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_two_ranks_equal_grad_scaler_and_ddp_and_one_rank_overflow_skips_everywhere(job):
    r0, r1 = w.ok(job, "scaler_against_ddp")
    for r in (r0, r1):
        assert r["unchanged"]
        for name in ("reduced", "local", "compiled"):
            assert r[f"{name}_scale"] == r["ddp_scale"], name
            assert all(eq[name] for eq in r["params_equal"]), (name, r["params_equal"])
        assert any(b > a for a, b in itertools.pairwise(r["ddp_scale"]))  # it grew
    at = aw.ONLY_RANK_1
    assert (r0["local_flag"][at], r1["local_flag"][at]) == (0.0, 1.0)  # one rank overflowed
    assert r0["ddp_scale"][at] == r0["ddp_scale"][at - 1] / 2  # and DDP's scaler backed off
    for name in ("reduced", "local", "compiled"):
        assert r0[f"{name}_found"] == r1[f"{name}_found"]  # every step, the ranks agree
        assert r0[f"{name}_found"][at] and r1[f"{name}_found"][at]
