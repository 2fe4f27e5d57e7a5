"""One-process data parallelism (being written: issue 3)."""

from typing import Any


def _todo(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("being written")


scatter = gather = parallel_apply = data_parallel = all_reduce = data_parallel_grad = _todo
