"""The benchmark models and the measuring method shared by every benchmark.

See ../shared/BENCHMARKS.md: three models (``many_small``, ``small_mlp``,
``mid_mlp``), ``torch.set_num_threads(1)``, interleaved A/B pairs with the
order alternated, the median of per-pair ratios.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

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


def ratios(
    candidates: Sequence[Callable[[], object]],
    *,
    pairs: int = 30,
    warmup: int = 3,
) -> list[float]:
    """Median ratio of each candidate's time to ``candidates[0]``'s (the baseline).

    Every round runs all candidates, rotating which goes first (A B C, B C A,
    ...); the ratio of each candidate to the baseline is taken within the
    round, and the median over rounds is returned (the baseline's is 1.0).
    """
    n = len(candidates)
    for _ in range(warmup):
        for fn in candidates:
            fn()
    per_round: list[list[float]] = [[] for _ in range(n)]
    for r in range(pairs):
        times = [0.0] * n
        for k in range(n):
            i = (r + k) % n
            times[i] = timed(candidates[i])
        for i in range(n):
            per_round[i].append(times[i] / times[0])
    return [statistics.median(v) for v in per_round]


def median_time(fn: Callable[[], object], *, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn) for _ in range(reps))


def row(label: str, values: Sequence[float], fmt: str = "{:>10.3f}") -> str:
    return f"{label:<44}" + "".join(fmt.format(v) for v in values)
