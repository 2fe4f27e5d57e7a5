"""How every benchmark reports: rows of absolute times beside ratios, each against its target.

A row is one measure, ``side / baseline`` on one model: the median time of
each (per call, or per step for the two-rank benchmark), the ratio (the
median over interleaved rounds of the per-round ratio, ../shared/BENCHMARKS.md,
not the ratio of the two medians) and, where the project set one, the
target it is held to, with ``met`` or ``missed``. The same rows make the
aligned table that ``freplicate bench`` prints and its plot of every ratio
against its target.
"""

from __future__ import annotations

import argparse
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from freplicate._demo._table import table


@dataclass(frozen=True)
class Row:
    benchmark: str
    measure: str  # what is divided by what: "fr.apply / module(x)"
    model: str
    side_s: float
    baseline_s: float
    ratio: float
    target: float | None = None  # the ratio must be at most this
    faults: float | None = None  # minor page faults per call of the side, where counted

    @property
    def status(self) -> str:
        if self.target is None:
            return "-"
        # judged on the ratio as the table prints it (3 decimals), so that a row
        # never reads "1.100  <= 1.10  missed"
        return "met" if round(self.ratio, 3) <= self.target else "missed"


def machine() -> str:
    cuda = (
        f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        if torch.cuda.is_available()
        else "no CUDA"
    )
    return (
        f"machine: {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, {cuda}; "
        f"Python {platform.python_version()}, torch {torch.__version__}, 1 thread per process"
    )


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


LEGEND = (
    "ratio: the median over interleaved rounds of side / baseline (not the ratio of the two "
    "medians); times: medians, per call (per step for a training step); lower is faster"
)


def lines(rows: Sequence[Row]) -> list[str]:
    """The aligned table of ``rows``: times in ms, ratio, target and whether it was met."""
    faults = any(r.faults is not None for r in rows)
    header = ["measure (side / baseline)", "model", "side ms", "baseline ms", "ratio"]
    header += ["target", "status"] + (["page faults"] if faults else [])
    body = []
    for r in rows:
        cells = [r.measure, r.model, _ms(r.side_s), _ms(r.baseline_s), f"{r.ratio:.3f}"]
        cells += ["-" if r.target is None else f"<= {r.target:.2f}", r.status]
        if faults:
            cells.append("" if r.faults is None else f"{r.faults:.0f}")
        body.append(cells)
    return table(header, body, "llrrrrl" + "r" * faults)


def command(title: str, run: Callable[..., list[Row]], argv: list[str] | None = None) -> None:
    """A benchmark's own command line: ``--quick`` or not, then its report."""
    parser = argparse.ArgumentParser(description=title)
    parser.add_argument("--quick", action="store_true", help="a smoke run with few rounds")
    show(title, run(quick=parser.parse_args(argv).quick))


def show(title: str, rows: Sequence[Row]) -> None:
    """Print one benchmark's report, as its own command (``python -m benchmarks.bench_...``) does."""
    print("\n".join([machine(), LEGEND, "", title, *lines(rows), "", *summary(rows)]))


def summary(rows: Sequence[Row]) -> list[str]:
    """One line counting targets met and missed, then a line per missed target."""
    held = [r for r in rows if r.target is not None]
    missed = [r for r in held if r.status == "missed"]
    out = [f"targets: {len(held) - len(missed)} met, {len(missed)} missed (of {len(held)})"]
    out += [f"  missed: {r.measure} on {r.model}: {r.ratio:.3f} > {r.target:.2f}" for r in missed]
    return out


def plot(rows: Sequence[Row], path: Path) -> Path:
    """A bar per row held to a target: its ratio (log scale) beside its target, met or missed."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    held = [r for r in rows if r.target is not None] or list(rows)  # none held: show them all
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(held) + 1.5))
    ys = list(range(len(held)))[::-1]
    colours = {"met": "tab:green", "missed": "tab:red", "-": "tab:gray"}
    ax.barh(ys, [r.ratio for r in held], color=[colours[r.status] for r in held], height=0.55)
    ticks = [(r.target, y) for r, y in zip(held, ys) if r.target is not None]
    ax.scatter([t or 0.0 for t, _ in ticks], [y for _, y in ticks], marker="|", s=260, c="k")
    for y, r in zip(ys, held):
        right = max(r.ratio, r.target or 0.0)
        status = "" if r.target is None else f" {r.status}"
        ax.text(right * 1.08, y, f"{r.ratio:.3f}{status}", va="center", fontsize=8)
    ax.set_yticks(ys, [f"{r.measure}  [{r.model}]" for r in held], fontsize=8)
    ax.axvline(1.0, color="k", lw=0.6, ls=":")
    ax.set_xscale("log")
    ax.set_xlim(right=max(max(r.ratio, r.target or 0.0) for r in held) * 3)
    ax.set_xlabel("bar: the ratio side / baseline (log scale; lower is faster); tick: its target")
    ax.set_title("freplicate bench: each ratio against its target (green met, red missed)")
    ax.grid(axis="x", alpha=0.3, which="both")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
