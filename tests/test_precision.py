"""Mixed precision (``mp_policy``, FSDP2's ``MixedPrecisionPolicy``) against FSDP2 on gloo ranks.

The model (``_precision_workers.Net``): an input layer, three blocks (the
units: LayerNorm, tanh, a residual), a head and a one-row parameter; rows of
7, which 2 ranks do not divide. Each side trains 3 AdamW steps from the same
weights on the same per-rank batches: FSDP2 with ``fully_shard`` on each
block and on the root, and freplicate's ZeRO-3 (``apply_sharded``, a unit
per block) or ZeRO-2 (``grad_and_value(shard=True)``), both with the same
policy object and ``torch.optim.AdamW`` on the shards.

Measured: on 2 ranks bit for bit (losses and every parameter), for
``param_dtype=bf16`` with ``reduce_dtype`` float32 or bf16 and with
``output_dtype``. On 3 ranks the mean's division differs (FSDP2 divides
after the sum, freplicate scales before it), so the bound is the rounding
of bf16 compute over 3 steps of AdamW at lr 1e-2 (see ``test_three_ranks``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the workers by name

pytest.importorskip("torch.distributed.fsdp")

import _precision_workers as workers

EQUAL = ["zero3_bf16_fp32", "zero3_bf16", "zero3_bf16_out", "zero2_bf16_fp32", "zero2_bf16"]


@pytest.fixture(scope="module")
def job() -> dict[str, list]:
    return workers.run([*EQUAL, "wire_dtypes", "refusals"])


@pytest.mark.parametrize("name", EQUAL)
def test_bit_for_bit_with_fsdp2(job: dict[str, list], name: str) -> None:
    for rank, got in enumerate(job[name]):
        assert isinstance(got, dict), got  # not ("raised", ...)
        result = got
        ours, theirs = result["losses"]
        assert ours == theirs, (rank, ours, theirs)
        assert all(d == 0.0 for d in result["max_diff"].values()), result["max_diff"]
        assert set(result["dtypes"].values()) == {"torch.float32"}  # the shards' own dtype


def test_the_wire_carries_param_dtype_and_reduce_dtype(job: dict[str, list]) -> None:
    for got in job["wire_dtypes"]:
        assert isinstance(got, dict), got  # not ("raised", ...)
        result = got
        gathers = [dtypes for kind, dtypes in result["sent"] if kind == "all_gather"]
        assert gathers and all(d == ["torch.bfloat16"] for d in gathers), result["sent"]
        assert result["out"] == ["torch.bfloat16"]  # no output_dtype: the compute's
        assert result["grads"] == ["torch.float32"]
        assert result["unchanged"]


def test_refusals_say_what_and_where(job: dict[str, list]) -> None:
    for got in job["refusals"]:
        assert isinstance(got, dict), got  # not ("raised", ...)
        result = got
        kind, message = result["transform"]
        assert kind == "NotImplementedError" and "reduce_dtype" in message and "eagerly" in message
        kind, message = result["not_a_policy"]
        assert kind == "TypeError" and "MixedPrecisionPolicy" in message
        kind, message = result["step_output"]
        assert kind == "ValueError" and "output_dtype" in message
        kind, message = result["step_both"]
        assert kind == "ValueError" and "compress" in message


def test_three_ranks() -> None:
    job = workers.run(["zero3_bf16_fp32", "zero2_bf16_fp32"], world=3)
    for name in ("zero3_bf16_fp32", "zero2_bf16_fp32"):
        for got in job[name]:
            assert isinstance(got, dict), got
            ours, theirs = got["losses"]
            assert ours[0] == theirs[0]  # the first forward: the same weights, the same casts
            assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-2 * max(map(abs, theirs))
            assert max(got["max_diff"].values()) <= 2e-2


def test_one_process_casts_as_well() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import freplicate as fr

    torch.manual_seed(0)
    model = workers.Net()
    params = fr.state(model).params
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    x = torch.randn(2, 5)

    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out, _ = fr.distributed.apply_sharded(model, fr.State(p, {}), x, mp_policy=mp)
        assert out.dtype == torch.float32
        return out.sum()

    grads, loss = fr.grad_and_value(loss_fn)(params)
    bf16 = {n: t.to(torch.bfloat16) for n, t in params.items()}
    want = fr.grad_and_value(
        lambda p: fr.apply(model, fr.State(p, {}), x.bfloat16())[0].float().sum()
    )(bf16)
    assert loss == want[1]
    for n, g in grads.items():
        assert g.dtype == torch.float32
        assert torch.equal(g, want[0][n].float())


class _Scaled(torch.nn.Module):
    """A block that mixes a float32 buffer into its output: the next unit's input is float32."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("scale", torch.rand(3) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_units_input_is_cast_compiled_as_eagerly(backend: str) -> None:
    """Each unit's input cast to param_dtype under torch.compile as eagerly (where it arrives in
    float32, after a buffer), the same bits; the module left as it was."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import freplicate as fr

    torch.manual_seed(0)
    model = torch.nn.Sequential(_Scaled(), _Scaled(), torch.nn.Linear(3, 2))
    state = fr.state(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    x = torch.randn(4, 3)

    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out, _ = fr.distributed.apply_sharded(model, fr.State(p, state.buffers), x, mp_policy=mp)
        return out.float().sum()

    params = {k: v.detach().clone().requires_grad_() for k, v in state.params.items()}
    eager = loss_fn(params)
    eager.backward()
    twin = {k: v.detach().clone().requires_grad_() for k, v in state.params.items()}
    compiled = torch.compile(loss_fn, backend=backend, fullgraph=True)(twin)
    compiled.backward()
    assert torch.equal(eager, compiled)
    for k in params:
        assert torch.equal(params[k].grad, twin[k].grad), k
    assert all("forward" not in m.__dict__ for m in model.modules())
