"""Names every doctest in the package may use, as a reader of the docs would import them."""

import pytest
import torch
from torch import nn

import freplicate as fr


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace: dict) -> None:
    doctest_namespace.update(torch=torch, nn=nn, fr=fr)


# The helper modules beside the tests (rank-side workers, oracles) hold no doctests, and
# some import their siblings by name, which only the spawned ranks put on sys.path:
# --doctest-modules must not import them.
collect_ignore_glob = ["tests/_*.py", "property_tests/_*.py"]
