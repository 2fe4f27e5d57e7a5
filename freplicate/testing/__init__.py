"""Property testing for freplicate and for your own models: ``fr.testing``.

Hypothesis strategies that draw trees of tensors, small modules with valid
inputs, and device lists; ``assert_trees_close``, which names the first path
at which two trees differ; ``check_against_stateful``, the oracle that
runs a module through ``fr.data_parallel`` and through PyTorch's stateful
DataParallel path on the same inputs and compares outputs, gradients and
buffers; ``check_against_ddp``, the oracle that trains a module with
``fr.distributed`` and with ``DistributedDataParallel`` on the ranks of a
``RankPool`` (gloo processes on this machine, loopback only, started once
and reused) and compares them phase by phase, evaluation included;
``check_reproducible``, which trains a module with
``fr.distributed.grad_and_value(..., grain=)`` on the ranks of pools of
several world sizes and asserts every rank ends each step with the bits of
one process; and ``init_loopback_group``, the gloo group those ranks join, for ranks you
start yourself. Needs the optional ``hypothesis`` dependency (from a clone
of the repository: ``pip install -e '.[testing]'``, or ``pip install
hypothesis``). Like a user's code, it relies only on the public face of
``freplicate``.

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
from ._ddp import check_against_ddp as check_against_ddp
from ._groups import init_loopback_group as init_loopback_group
from ._oracle import check_against_stateful as check_against_stateful
from ._pool import RankPool as RankPool
from ._reproducible import check_reproducible as check_reproducible
from ._strategies import devices as devices
from ._strategies import modules as modules
from ._strategies import trees as trees

__all__ = [
    "RankPool",
    "assert_trees_close",
    "check_against_ddp",
    "check_against_stateful",
    "check_reproducible",
    "devices",
    "init_loopback_group",
    "modules",
    "trees",
]
