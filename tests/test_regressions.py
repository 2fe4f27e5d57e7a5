"""Regressions found by the property suite (property_tests/), one test per bug, smallest repro.

A bug in code this file's author does not own is marked ``xfail(strict=True)``
until its owner fixes it: the fix turns the test into an unexpected pass,
which fails the suite until the mark (and any ``assume`` in the property that
steps around the bug) is removed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import freplicate as fr


class _Total(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()


@pytest.mark.xfail(
    strict=True,
    reason="fr.data_parallel gathers even on a single device, so a 0-dim output comes back "
    "with shape (1,); nn.DataParallel with one device calls the module directly and returns "
    "the 0-dim output as is: owner must fix (freplicate/_parallel.py)",
)
def test_data_parallel_on_one_device_returns_the_output_as_the_module_does():
    # found by property_tests/test_data_parallel.py::test_data_parallel_equals_the_stateful_oracle
    torch.manual_seed(0)
    module, x = _Total(), torch.randn(3, 2)
    out, _ = fr.data_parallel(module, fr.state(module), x, devices=["cpu"])
    # nn.DataParallel(module, device_ids=[0]) returns module(*scatter(x)[0]): shape ()
    assert out.shape == module(x).shape == torch.Size([])
