"""freplicate: PyTorch's module replication as pure functions on parameter trees.

>>> import freplicate as fr
>>> model = torch.nn.Linear(4, 2)
>>> s = fr.state(model)
>>> replicas = fr.replicate(s, ["cpu", "cpu"])
>>> out, _ = fr.apply(model, replicas[1], torch.ones(3, 4))
>>> out.shape
torch.Size([3, 2])
"""

from typing import TYPE_CHECKING, Any

from ._amp import GradScaler as GradScaler
from ._apply import apply as apply
from ._caches import clear_caches as clear_caches
from ._checkpoint import from_state_dict as from_state_dict
from ._checkpoint import optimizer_state_by_index as optimizer_state_by_index
from ._checkpoint import optimizer_state_by_name as optimizer_state_by_name
from ._checkpoint import to_state_dict as to_state_dict
from ._clip import clip_grad_norm as clip_grad_norm
from ._grad import grad_and_value as grad_and_value
from ._parallel import all_reduce as all_reduce
from ._parallel import data_parallel as data_parallel
from ._parallel import data_parallel_grad as data_parallel_grad
from ._parallel import gather as gather
from ._parallel import parallel_apply as parallel_apply
from ._parallel import scatter as scatter
from ._replicate import replicate as replicate
from ._state import State as State
from ._state import combine as combine
from ._state import partition as partition
from ._state import state as state

if TYPE_CHECKING:
    from . import distributed as distributed

__version__ = "0.1.0"

# ``testing`` is left out of ``__all__``: ``from freplicate import *`` must work
# without its optional ``hypothesis`` dependency (``fr.testing`` still imports it).
__all__ = [
    "GradScaler",
    "State",
    "all_reduce",
    "apply",
    "clear_caches",
    "clip_grad_norm",
    "combine",
    "data_parallel",
    "data_parallel_grad",
    "distributed",
    "from_state_dict",
    "gather",
    "grad_and_value",
    "optimizer_state_by_index",
    "optimizer_state_by_name",
    "parallel_apply",
    "partition",
    "replicate",
    "scatter",
    "state",
    "to_state_dict",
]


def __getattr__(name: str) -> Any:
    # Imported on first use: fr.testing, which needs the optional `hypothesis` dependency, and
    # fr.distributed, which is most of the package's code (`import freplicate` takes about
    # half as long without it; a process that never runs a collective never pays for it).
    if name in ("testing", "distributed"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'freplicate' has no attribute {name!r}")
