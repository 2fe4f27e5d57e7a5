"""Names every doctest in the package may use, as a reader of the docs would import them."""

import pytest
import torch
from torch import nn

import freplicate as fr


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace: dict) -> None:
    doctest_namespace.update(torch=torch, nn=nn, fr=fr)
