"""Compiled modules: ``fr.apply(torch.compile(m), state, ...)`` computes with ``state``.

And a submodule compiled in place (``sub.compile()``), whose compiled code
is a closure over the original submodule: fr.apply's copy runs uncompiled,
with the state's tensors (compiled calls of ``fr.apply`` itself are the
properties of ``test_modes.py``).

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

uncompiled = modules(kinds=["mlp", "tied", "buffers", "nested", "shared"], dtypes=(torch.float32,))

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


@examples(0.1, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(uncompiled, st.integers(0, 2**16), st.sampled_from(HOWS), st.data())
def test_a_submodule_compiled_in_place_computes_with_the_state(
    pair: tuple[torch.nn.Module, Any], seed: int, how: How, data: st.DataObject
):
    torch.compiler.reset()
    module, inputs = pair
    holders = [m for m in module.modules() if m._parameters]
    data.draw(st.sampled_from(holders), label="compiled in place").compile(backend="eager")
    x = data.draw(inputs, label="inputs")
    check_gradients(problem(module, x, values_seed=seed, wrt_inputs=False), how)
