"""Compiled modules: ``fr.apply(torch.compile(m), state, ...)`` computes with ``state``.

The stateful reference is the module ``torch.compile`` wrapped, its values
loaded, driven by autograd: compiling changes how a forward runs, never what
it computes. Compiling costs about a second an example, so these run few, and
a failing example is reported as drawn, unshrunk.
"""

from __future__ import annotations

from typing import Any

import torch
from _property_oracle import HOWS, How, check_gradients, problem
from _property_support import examples
from hypothesis import Phase, given
from hypothesis import strategies as st

from freplicate.testing import modules

compiled = modules(
    kinds=["mlp", "tied", "buffers", "nested"],
    dtypes=(torch.float32, torch.float64),
    compiled=True,
    frozen=None,
)


# no shrinking: every attempt would compile again (minutes for one failure)
@examples(0.1, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(compiled, st.integers(0, 2**16), st.sampled_from(HOWS), st.data())
def test_gradients_through_apply_equal_the_stateful_module(
    pair: tuple[torch.nn.Module, Any], seed: int, how: How, data: st.DataObject
):
    torch.compiler.reset()  # a fresh compile each example, never the recompile limit's fallback
    module, inputs = pair
    x = data.draw(inputs, label="inputs")
    check_gradients(problem(module, x, values_seed=seed, wrt_inputs=False), how)
