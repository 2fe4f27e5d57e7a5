"""The demo's data and models: scikit-learn's digits, a fixed split, an MLP and a CNN.

The digits (1,797 8x8 grey images of the ten digits) ship inside
scikit-learn, so nothing is downloaded. The split is fixed (a stratified
quarter held out, ``random_state=0``), the pixels standardised with the
training set's statistics, and the batch order drawn from a generator of its
own, so that every path of the demo sees the same batches in the same order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

MODELS = ("mlp", "cnn")


class Digits(NamedTuple):
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load(dtype: torch.dtype = torch.float32) -> Digits:
    """The fixed split, standardised: 1,347 training and 450 test examples of 64 pixels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=0, stratify=y
    )
    xtr = torch.tensor(x_train, dtype=dtype)
    xte = torch.tensor(x_test, dtype=dtype)
    # pixels that never vary (the corners) keep a scale of 1 instead of dividing by ~0
    mean, std = xtr.mean(0), xtr.std(0).clamp_min(1.0)
    return Digits(
        (xtr - mean) / std,
        torch.tensor(y_train),
        (xte - mean) / std,
        torch.tensor(y_test),
    )


def batch_order(
    n: int, batch_size: int, epochs: int, steps: int | None
) -> list[list[torch.Tensor]]:
    """Per epoch, the index tensors of its batches: a fresh shuffle each epoch, a partial last batch dropped.

    Dropping the remainder keeps every batch one shape (a compiled step
    compiles once) while the shuffle lets every example take part over the
    epochs; ``steps`` cuts each epoch short (for quick runs).
    """
    g = torch.Generator().manual_seed(0)
    order = []
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        batches = list(perm[: n - n % batch_size].split(batch_size))
        order.append(batches[:steps])
    return order


def model(kind: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A freshly initialised model, seeded without touching the global generator."""
    return _build(kind, seed).to(dtype)


def _build(kind: str, seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "mlp":
            return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        if kind == "cnn":
            return nn.Sequential(
                nn.Unflatten(1, (1, 8, 8)),
                nn.Conv2d(1, 16, 3, padding=1),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(16, 32, 3, padding=1),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(32 * 4 * 4, 10),
            )
    raise ValueError(f"unknown model {kind!r}; expected one of {MODELS}")
