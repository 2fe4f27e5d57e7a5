"""Fixtures for every test directory: the doctests' names, and the session's two ranks.

``rank_pool``: two gloo ranks on this machine (``fr.testing.RankPool``:
loopback only, every wait bounded), started once for the whole session and
shared by the modules that run functions on 2 ranks: ``tests/test_evaluation.py``,
``tests/test_testing_ddp.py`` and the property files, each of these bounding its
runs by its own deadline (``_property_support.bounded``). A start costs seconds
(about 1.4 s of CPU a rank, importing torch), and every property file once started
its own; ``test_docs_ddp_example.py`` still does, as docs/property_testing.md quotes
it whole. A failing run leaves the pool usable for the next.
"""

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import freplicate as fr
from freplicate.testing import RankPool


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace: dict) -> None:
    doctest_namespace.update(torch=torch, nn=nn, fr=fr)


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[RankPool]:
    with RankPool(2, timeout=30.0, deadline=120.0) as pool:
        yield pool


# The helper modules beside the tests (rank-side workers, oracles) hold no doctests, and
# some import their siblings by name, which only the spawned ranks put on sys.path:
# --doctest-modules must not import them.
collect_ignore_glob = ["tests/_*.py", "property_tests/_*.py"]
