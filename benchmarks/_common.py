"""The benchmark models and the measuring method shared by every benchmark.

See ../shared/BENCHMARKS.md: three models (``many_small``, ``small_mlp``,
``mid_mlp``), ``torch.set_num_threads(1)``, interleaved A/B pairs with the
order alternated, the median of per-pair ratios.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

MODELS = ("many_small", "small_mlp", "mid_mlp")


def build(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """``(model, input, target)`` for one benchmark model, seeded with 0."""
    torch.manual_seed(0)
    if name == "many_small":
        layers: list[nn.Module] = []
        for _ in range(200):
            layers += [nn.Linear(16, 16), nn.Tanh()]
        model: nn.Module = nn.Sequential(*layers)
        x, classes = torch.randn(64, 16), 16
    elif name == "small_mlp":
        model = nn.Sequential(
            nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)
        )
        x, classes = torch.randn(64, 256), 10
    elif name == "mid_mlp":
        model = nn.Sequential(
            nn.Linear(1024, 2048),
            nn.ReLU(),
            nn.Linear(2048, 2048),
            nn.ReLU(),
            nn.Linear(2048, 2048),
            nn.ReLU(),
            nn.Linear(2048, 10),
        )
        x, classes = torch.randn(64, 1024), 10
    else:
        raise ValueError(f"unknown benchmark model {name!r}; expected one of {MODELS}")
    y = torch.randint(0, classes, (x.shape[0],))
    return model, x, y


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass
class Rounds:
    """Interleaved timings: ``times[r][i]`` is candidate ``i``'s time in round ``r``.

    ``faults[i]`` is candidate ``i``'s minor page faults per call over the
    same rounds (counted around each call, outside its timing).
    """

    times: list[list[float]]
    faults: list[float]

    def ratio(self, i: int, j: int = 0) -> float:
        """The median over rounds of candidate ``i``'s time / candidate ``j``'s in that round."""
        return statistics.median(t[i] / t[j] for t in self.times)

    def median(self, i: int) -> float:
        """Candidate ``i``'s median time, in seconds."""
        return statistics.median(t[i] for t in self.times)


def interleave(
    candidates: Sequence[Callable[[], object]], *, pairs: int = 30, warmup: int = 3
) -> Rounds:
    """Time every candidate once a round, rotating which goes first (A B C, B C A, ...)."""
    n = len(candidates)
    for _ in range(warmup):
        for fn in candidates:
            fn()
    times = []
    faults = [0] * n
    for r in range(pairs):
        t = [0.0] * n
        for k in range(n):
            i = (r + k) % n
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t[i] = timed(candidates[i])
            faults[i] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        times.append(t)
    return Rounds(times, [f / pairs for f in faults])
