"""The demo's final table and its plot of the loss and accuracy curves, fr beside stateful."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ._record import PathResult
from ._table import table


def summary(results: Sequence[PathResult], steps_per_epoch: int) -> list[str]:
    rows = []
    notes = []
    for r in results:
        a = r.agreement
        if r.failed or r.skipped:
            outcome = "failed" if r.failed else "skipped"
            rows.append([r.title, r.twin_title, *["-"] * 4, f"{r.wall_s:.0f}", outcome])
            notes.append(f"{r.title[:3]} {r.failed or r.skipped}")
            continue
        rows.append(
            [
                r.title,
                r.twin_title,
                f"{r.fr.accuracy[-1]:.3f} / {r.twin.accuracy[-1]:.3f}",
                f"{r.fr.ms_per_epoch(steps_per_epoch):.1f} / {r.twin.ms_per_epoch(steps_per_epoch):.1f}",
                f"{a.params:.1e}",
                f"{a.grads:.1e}",
                f"{r.wall_s:.0f}",
                "yes" if a.agrees else "NO",
            ]
        )
        if r.note:
            notes.append(f"{r.title[:3]} {r.note}")
        if a.first_miss:
            notes.append(f"{r.title[:3]} first miss: {a.first_miss}")
    header = [
        "path",
        "twin",
        "test acc (fr / twin)",
        "ms/epoch (fr / twin)",
        "max |Δ param|",
        "max |Δ grad|",
        "wall s",
        "agree",
    ]
    return table(header, rows, "llrrrrrl") + notes


def plot(results: Sequence[PathResult], path: Path) -> Path:
    """Loss per step and test accuracy per epoch, one column per path that ran."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    shown = [r for r in results if not (r.failed or r.skipped)]
    fig, axes = plt.subplots(2, len(shown), figsize=(4.6 * len(shown), 6.4), squeeze=False)
    for col, r in enumerate(shown):
        loss_ax, acc_ax = axes[0][col], axes[1][col]
        for side, style in (
            (r.fr, dict(lw=2.2, alpha=0.8)),
            (r.twin, dict(lw=1.2, ls="--", color="k")),
        ):
            loss_ax.plot(side.losses, label=side.label, **style)  # type: ignore[arg-type]
            epochs = range(1, len(side.accuracy) + 1)
            acc_ax.plot(epochs, side.accuracy, marker="o", label=side.label, **style)  # type: ignore[arg-type]
        loss_ax.set_title(f"{r.title}\nvs {r.twin_title}", fontsize=8)
        loss_ax.set_xlabel("step")
        loss_ax.set_ylabel("training loss")
        loss_ax.set_yscale("log")
        acc_ax.set_xlabel("epoch")
        acc_ax.set_ylabel("test accuracy")
        acc_ax.text(
            0.97,
            0.05,
            f"max |Δ param| {r.agreement.params:.1e}",
            transform=acc_ax.transAxes,
            ha="right",
            fontsize=8,
        )
        for ax in (loss_ax, acc_ax):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("freplicate demo: digits, functional beside stateful", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
