"""What a path of the demo records: each side's curves and times, and how closely the sides agree.

A *path* trains one model twice from the same initial weights on the same
batches: the functional side (freplicate) and its stateful twin (PyTorch's
own design). After every step the two are compared (the loss, every
gradient, every parameter) against a tolerance; the largest differences and
the first step that broke the tolerance are kept for the final table.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

Tree = Mapping[str, torch.Tensor]  # read only: a step's results, or a module's parameters


@dataclass(frozen=True)
class Tolerance:
    """The largest absolute differences between the two sides taken as agreement."""

    loss: float
    grads: float
    params: float

    def describe(self) -> str:
        return (
            f"|Δ loss| <= {self.loss:.0e}, max |Δ grad| <= {self.grads:.0e}, "
            f"max |Δ param| <= {self.params:.0e}"
        )


def max_diff(a: Tree, b: Tree) -> float:
    """The largest absolute leaf-wise difference, in float64 on the CPU."""
    return max(
        float((a[k].detach().double().cpu() - b[k].detach().double().cpu()).abs().max()) for k in a
    )


@dataclass
class Agreement:
    """Running maxima of the differences between a path's two sides, and the first miss."""

    tolerance: Tolerance
    loss: float = 0.0
    grads: float = 0.0
    params: float = 0.0
    first_miss: str | None = None

    def check(
        self,
        step: int,
        loss: float,
        twin_loss: float,
        grads: Tree,
        twin_grads: Tree,
        params: Tree,
        twin_params: Tree,
    ) -> str | None:
        """Compare one step; return a description of the miss if this is the first one."""
        found = {
            "loss": abs(loss - twin_loss),
            "grad": max_diff(grads, twin_grads),
            "param": max_diff(params, twin_params),
        }
        self.loss = max(self.loss, found["loss"])
        self.grads = max(self.grads, found["grad"])
        self.params = max(self.params, found["param"])
        limits = {
            "loss": self.tolerance.loss,
            "grad": self.tolerance.grads,
            "param": self.tolerance.params,
        }
        over = [
            f"max |Δ {k}| = {v:.2e} > {limits[k]:.0e}"
            for k, v in found.items()
            if not v <= limits[k]
        ]
        if over and self.first_miss is None:
            self.first_miss = f"step {step}: " + ", ".join(over)
            return self.first_miss
        return None

    @property
    def agrees(self) -> bool:
        return self.first_miss is None


@dataclass
class Side:
    """One side of a path: training loss and time per step, test accuracy per epoch."""

    label: str
    losses: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)

    def ms_per_epoch(self, steps_per_epoch: int) -> float:
        """The mean step time (a compiling call is not one of them) times the steps of an epoch."""
        return (
            1e3 * statistics.fmean(self.step_s) * steps_per_epoch if self.step_s else float("nan")
        )


@dataclass
class PathResult:
    """A path's outcome: both sides, their agreement, or why it did not run."""

    title: str
    twin_title: str
    fr: Side
    twin: Side
    agreement: Agreement
    skipped: str | None = None
    failed: str | None = None
    note: str = ""
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.failed is None and (self.skipped is not None or self.agreement.agrees)


# Why these tolerances. Both sides do the same arithmetic on the same data
# but not in the same order: fr averages the replicas' gradients after the
# backward (sum, then divide), the stateful twin scales each shard's loss
# before it (DataParallel through the mean of the losses, DDP dividing each
# bucket by the world size), and summing in another order rounds
# differently: a few units in the last place of each gradient element. The
# difference is exactly 0 where the scale is a power of two (1 or 2
# replicas, 2 ranks) and, in float64, ~1e-16 per step and ~1e-15 after 210
# AdamW steps (measured on 3 and 5 CPU replicas, the MLP and the CNN). A real
# error is some twelve orders above that: weighting 3 uneven shards by their
# examples instead of averaging the shard means moves the first gradient by
# ~3e-3, a gradient off by 1% by ~1e-3. 1e-9 sits in between with six orders
# of margin either side. In float32 the rounding is ~1e-7 (measured 1.3e-7 on
# the parameters after 210 steps of the MLP): 1e-5 keeps two orders over it
# and still catches both errors, but a model whose gradient jumps (a max-pool
# near-tie broken the other way) can drift apart in float32 after a few
# hundred steps, which is why float64 is the default.
TOLERANCES = {
    "float64": Tolerance(loss=1e-9, grads=1e-9, params=1e-9),
    "float32": Tolerance(loss=1e-5, grads=1e-5, params=1e-5),
}
