"""Fixtures shared by the test modules.

``rank_pool``: two gloo ranks on this machine (``fr.testing.RankPool``:
loopback only, every wait bounded), started once for the whole session and
shared by the modules that run functions on ranks (``test_evaluation.py``,
``test_testing_ddp.py``): a start costs seconds. A failing run leaves it
usable for the next.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from freplicate.testing import RankPool


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[RankPool]:
    with RankPool(2, timeout=30.0, deadline=120.0) as pool:
        yield pool
