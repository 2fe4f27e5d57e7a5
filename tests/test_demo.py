"""The main job: the demo runs, agrees with the stateful path, and would say so if it did not."""

from __future__ import annotations

import pytest
import torch

import freplicate as fr
from freplicate import _demo
from freplicate.__main__ import main


def test_demo_agrees_with_the_stateful_paths(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "OK: the functional and stateful paths agree" in out
    assert "DistributedDataParallel, 2 gloo ranks on 127.0.0.1" in out


def test_demo_reports_a_mismatch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = fr.grad_and_value

    def off_by_a_little(fn, **kw):  # type: ignore[no-untyped-def]
        g = real(fn, **kw)

        def wrong(*args):  # type: ignore[no-untyped-def]
            grads, value = g(*args)
            return {k: v * 1.01 for k, v in grads.items()}, value

        return wrong

    monkeypatch.setattr(fr, "grad_and_value", off_by_a_little)
    monkeypatch.setattr(_demo, "_two_processes", lambda *a, **k: True)
    assert not _demo.demo(steps=2, devices=["cpu", "cpu"])
    assert "MISMATCH" in capsys.readouterr().out
    assert torch.is_grad_enabled()
