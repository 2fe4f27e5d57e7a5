"""Property testing for freplicate and for your own models: ``fr.testing``.

Hypothesis strategies that draw trees of tensors, small modules with valid
inputs, and device lists; ``assert_trees_close``, which names the first path
at which two trees differ; and ``check_against_stateful``, the oracle that
runs a module through ``fr.data_parallel`` and through PyTorch's stateful
DataParallel path on the same inputs and compares outputs, gradients and
buffers; ``init_loopback_group``, a gloo group for multi-process tests on
one machine that talks over loopback only. Needs the optional ``hypothesis`` dependency
(from a clone of the repository: ``pip install -e '.[testing]'``, or ``pip install hypothesis``). Like a user's code, it relies only
on the public face of ``freplicate``.

>>> import freplicate as fr
>>> fr.testing.assert_trees_close({"w": torch.ones(2)}, {"w": torch.ones(2)})
"""

try:
    import hypothesis as _hypothesis  # noqa: F401
except ImportError as err:
    raise ImportError(
        "fr.testing needs the optional 'hypothesis' dependency: pip install hypothesis "
        "(or, from a clone of the repository, pip install -e '.[testing]')"
    ) from err

from ._assertions import assert_trees_close as assert_trees_close
from ._groups import init_loopback_group as init_loopback_group
from ._oracle import check_against_stateful as check_against_stateful
from ._strategies import devices as devices
from ._strategies import modules as modules
from ._strategies import trees as trees

__all__ = [
    "assert_trees_close",
    "check_against_stateful",
    "devices",
    "init_loopback_group",
    "modules",
    "trees",
]
