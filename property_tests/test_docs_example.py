"""Property tests for my model: freplicate's functional path equals PyTorch's stateful one."""

import copy

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import freplicate as fr
from freplicate.testing import assert_trees_close, check_against_stateful, devices, trees


class MyModel(nn.Module):
    def __init__(self, features: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def batches(min_size: int = 2, max_size: int = 16) -> st.SearchStrategy[torch.Tensor]:
    """Batches of MyModel inputs; values from a drawn seed, so they shrink and replay."""

    def make(size: int, seed: int) -> torch.Tensor:
        return torch.randn(size, 8, generator=torch.Generator().manual_seed(seed))

    return st.builds(make, st.integers(min_size, max_size), st.integers(0, 2**16))


@settings(deadline=None)
@given(devices(), st.booleans(), st.data())
def test_data_parallel_equals_dataparallel(devs, training, data):
    torch.manual_seed(0)
    model = MyModel().train(training)
    # BatchNorm in training mode needs two rows in every replica's shard, and torch.chunk
    # cuts 10 rows for 4 devices as 3 + 3 + 3 + 1: draw a multiple of the device count
    rows = data.draw(st.integers(2, 4), label="rows per device") * len(devs)
    x = data.draw(batches(min_size=rows, max_size=rows), label="x")
    check_against_stateful(model, (x,), devs)


@settings(deadline=None)
@given(batches(), st.integers(0, 2**16))
def test_functional_sgd_step_equals_the_optimizer(x, seed):
    torch.manual_seed(0)
    model = MyModel()
    y = torch.randint(0, 3, (len(x),), generator=torch.Generator().manual_seed(seed))

    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    F.cross_entropy(reference(x), y).backward()
    optimizer.step()

    s = fr.state(model)

    def loss_fn(params):
        out, new = fr.apply(model, fr.State(params, s.buffers), x)
        return F.cross_entropy(out, y), new.buffers

    grads, (_, buffers) = fr.grad_and_value(loss_fn, has_aux=True)(s.params)
    params = {name: p - 0.1 * grads[name] for name, p in s.params.items()}
    assert_trees_close(fr.State(params, buffers), fr.state(reference))


def save_and_load(tree):
    """My checkpoint code: it must give back every tree as it was."""
    import io

    buffer = io.BytesIO()
    torch.save(tree, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@settings(deadline=None)
@given(trees())
def test_checkpoints_round_trip(tree):
    assert_trees_close(save_and_load(tree), tree, rtol=0, atol=0)
