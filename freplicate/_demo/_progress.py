"""The progress bar while a path trains: tqdm on stderr, silent when stderr is not a terminal."""

from __future__ import annotations

import sys
from typing import Any


def bar(title: str, total: int) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=title,
        unit="step",
        file=sys.stderr,
        disable=None,  # None: off unless stderr is a terminal (logs and pipes stay clean)
        leave=False,
        dynamic_ncols=True,
    )


def say(line: str) -> None:
    """Print a line on stdout without tearing a progress bar that is being drawn."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)
