"""The main job: the demo trains, agrees with the stateful paths, and says so when it does not.

Every run here is short (one epoch of a few steps); the demo's own checks
run after every step just the same. The whole file takes well under a
minute on a 2-core machine: one run spawns the two gloo ranks, the others
stay in this process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import freplicate as fr
from freplicate.__main__ import main
from freplicate._demo import _adamw, _ranks, _single

QUICK = ["--epochs", "1", "--steps", "3"]
LOCAL = [*QUICK, "--no-distributed", "--no-compile"]


def _demo(tmp_path: Path, *args: str) -> int:
    return main(["demo", *args, "--out", str(tmp_path)])


def test_every_path_agrees_and_the_plot_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _demo(tmp_path, *QUICK, "--compile") == 0
    out = capsys.readouterr().out
    assert "OK: every path agrees with its stateful twin at every step." in out
    rows = [line for line in out.splitlines() if line[:4] in ("(a) ", "(b) ", "(c) ")]
    assert any("fr.data_parallel_grad" in r and r.endswith("yes") for r in rows), out
    assert any("fr.distributed, 2 gloo ranks" in r and r.endswith("yes") for r in rows), out
    # compiling may fail while compile support is being built: then the row says skipped
    assert any("torch.compile" in r and r.endswith(("yes", "skipped")) for r in rows), out
    png = tmp_path / "curves.png"
    assert f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("n", [1, 3, 5])
def test_uneven_shards_agree_on_any_number_of_cpus(
    n: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 64 examples on 3 or 5 replicas: uneven torch.chunk shards, whose mean of
    # shard means is not the full-batch gradient; both sides must compute it
    assert _demo(tmp_path, *LOCAL, "--devices", *["cpu"] * n) == 0, capsys.readouterr().out
    assert "OK: every path agrees" in capsys.readouterr().out


@pytest.mark.parametrize("variant", [["--model", "cnn"], ["--dtype", "float32"]])
def test_the_cnn_and_float32_agree(
    variant: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*LOCAL, "--devices", "cpu", "cpu", "cpu", *variant]
    assert _demo(tmp_path, *args) == 0, capsys.readouterr().out


def test_a_wrong_gradient_is_a_mismatch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = fr.data_parallel_grad

    def off_by_one_percent(loss_fn, devices, **kw):  # type: ignore[no-untyped-def]
        step = real(loss_fn, devices, **kw)

        def wrong(params, *batch):  # type: ignore[no-untyped-def]
            grads, loss = step(params, *batch)
            return {k: g * 1.01 for k, g in grads.items()}, loss

        return wrong

    monkeypatch.setattr(fr, "data_parallel_grad", off_by_one_percent)
    assert _demo(tmp_path, *LOCAL) == 1
    out = capsys.readouterr().out
    assert "MISMATCH in (a) at step 0: max |Δ grad|" in out
    assert "MISMATCH: a functional path and its stateful twin disagree" in out
    assert torch.is_grad_enabled()


def test_the_compiled_path_is_compared_with_the_eager_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # compiling takes tens of seconds here: a stand-in that compiles nothing
    # exercises the comparison, the real one is the demo's default run
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    assert _demo(tmp_path, *QUICK, "--no-distributed", "--compile") == 0
    out = capsys.readouterr().out
    assert any(line.startswith("(c) ") and line.endswith("yes") for line in out.splitlines()), out


def test_a_compile_that_fails_is_skipped_not_fatal(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(fn, **kw):  # type: ignore[no-untyped-def]
        def call(*args):  # type: ignore[no-untyped-def]
            raise RuntimeError("no compiler here\nand more lines")

        return call

    monkeypatch.setattr(torch, "compile", broken)
    assert _demo(tmp_path, *QUICK, "--no-distributed", "--compile") == 0
    out = capsys.readouterr().out
    assert "(c) skipped: RuntimeError: no compiler here" in out
    assert "and more lines" not in out


def test_a_compiled_path_past_its_time_is_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(_single, "COMPILE_LIMIT_S", 0.0)
    assert _demo(tmp_path, *QUICK, "--no-distributed", "--compile") == 0
    out = capsys.readouterr().out
    assert "(c) skipped: compiling and training took over 0 s (1 of 3 steps done)" in out


def test_ranks_that_do_not_answer_in_time_are_named_and_stopped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import multiprocessing

    monkeypatch.setattr(_ranks, "TIMEOUT_S", 0.0)
    assert _demo(tmp_path, *QUICK, "--no-compile") == 1
    out = capsys.readouterr().out
    # each late rank is asked for its Python stack (SIGUSR1), then stopped: nothing hangs
    assert "(b) rank 0 has not answered: its Python stack follows" in out
    assert "(b) failed: rank 0 did not answer within 0 s" in out
    assert "FAILED: (b) did not run to the end (see above); nothing disagreed." in out
    assert not multiprocessing.active_children()


ERRORS = [
    (["--devices", "gpu"], "unknown device 'gpu'"),
    (["--devices", "cpu", "cpu:0"], "unknown device 'cpu:0'"),
    (["--devices", *["cpu"] * 9], "at most 8 CPU devices (got 9)"),
    (["--steps", "0"], "--steps must be at least 1 (got 0)"),
    (["--epochs", "-2"], "--epochs must be at least 1 (got -2)"),
    (["--batch-size", "1"], "--batch-size must be at least 2"),
    (["--batch-size", "5000"], "--batch-size must be at most 1347"),
    (["--epochs", "two"], "argument --epochs: invalid int value: 'two'"),
    (["--model", "resnet"], "argument --model: invalid choice: 'resnet'"),
]
if not torch.cuda.is_available():
    ERRORS.append((["--devices", "cuda:0"], "'cuda:0' needs CUDA, which is not available here"))


@pytest.mark.parametrize(("args", "message"), ERRORS)
def test_bad_options_are_one_line_errors(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = _demo(tmp_path, *args)
    except SystemExit as exc:  # argparse's own errors exit from inside parse_args
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and message in lines[0], captured.err
    assert lines[0].startswith("freplicate demo: error: ")


def test_functional_adamw_is_torch_adamw_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state = _adamw.init(params)
    for i in range(20):
        # gradients over six orders of magnitude, so that eps and the bias corrections matter
        grads = {k: torch.randn_like(v) * 10.0 ** (i % 7 - 5) for k, v in params.items()}
        given, before = params, {k: v.clone() for k, v in params.items()}
        for k, p in model.named_parameters():
            p.grad = grads[k].clone()
        opt.step()
        params, state = _adamw.update(params, grads, state, lr=3e-3)
        for k, p in model.named_parameters():
            assert torch.equal(params[k], p.detach()), (i, k)
        assert all(torch.equal(given[k], v) for k, v in before.items())  # inputs left as they were
