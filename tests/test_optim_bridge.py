"""Optimizers and schedules users already have, beside DDP + ``torch.optim`` on 2 gloo ranks.

``docs/optimizers.md`` tells the story; the ranks' code is ``_interop_workers.py``:

- the bridge: ``fr.distributed.grad_and_value``'s gradients put into ``.grad``
  of the module's parameters and ``opt.step()``, for seven ``torch.optim``
  optimizers, each under one of three ``torch.optim.lr_scheduler`` schedules
  (in turn): bit for bit
  DDP + the same optimizer and schedule (the same gradients, then torch's own
  code), every parameter and buffer after 12 steps, and every rate;
- torchopt's ``sgd(momentum, nesterov, weight_decay)`` with torchopt's
  schedules: close, not bit for bit (the rate in float32, the step a multiply
  then an add where torch fuses ``add(alpha=-lr)``);
- torchopt's ``sgd(lr=1.0)`` for the direction, the rate from torch's own
  scheduler (driven on a stand-in optimizer) and ``p.add(u, alpha=lr)``:
  bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import freplicate as fr

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the workers by name
import _interop_workers as w
from _dist_workers import ok

pytest.importorskip("torchopt")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


@pytest.fixture(scope="module")
def job() -> dict[str, list[Any]]:
    return w.run(["bridge", "torchopt_sgd"], deadline=180.0)


def bitwise(actual: Any, expected: Any) -> None:
    fr.testing.assert_trees_close(actual, expected, rtol=0, atol=0)


def test_every_torch_optimizer_under_a_schedule_through_grad_is_ddps_bit_for_bit(job):
    for r in ok(job, "bridge"):
        assert {opt for opt, _ in r} == set(w.OPTIMIZERS)
        assert {sched for _, sched in r} == set(w.SCHEDULES)
        for (opt, sched), c in r.items():
            lrs, ddp_lrs = c["lrs"]
            assert lrs == ddp_lrs and len(set(lrs)) > 2, (opt, sched, lrs)
            try:
                bitwise(c["fr"], c["ddp"])
            except AssertionError as err:
                raise AssertionError(f"{opt} under {sched}: {err}") from None


def relative_gap(got: dict[str, Any], want: dict[str, Any]) -> float:
    return max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)


def test_torchopt_sgd_with_its_schedules_is_close_and_exact_with_torchs_rate(job):
    for r in ok(job, "torchopt_sgd"):
        for name, c in r.items():
            bitwise(c["exact"], c["ddp"])
            gap = relative_gap(c["torchopt"]["params"], c["ddp"]["params"])
            # measured: 6.6e-8 (StepLR), 8.6e-8 (warm-up + cosine) after 12 steps, with 93% of
            # the parameters' values bit for bit
            assert 0 < gap < 1e-6, (name, gap)
