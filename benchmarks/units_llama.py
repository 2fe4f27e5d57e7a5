"""ZeRO-3's peak memory on a Hugging Face Llama, by the rule that chooses the units.

Run ``.venv/bin/python -m benchmarks.units_llama`` (needs ``transformers``).
For each rule, two fresh gloo ranks on 127.0.0.1 (``_common.on_two_ranks``)
build the same random ``LlamaForCausalLM`` (27M parameters: vocabulary
8000, hidden 512, 6 decoder layers), shard it, run one warm-up step, then
one measured step: ``fr.grad_and_value`` of the causal-LM loss through
``fr.distributed.apply_sharded``. The figure is rank 0's live heap
(glibc's ``mallinfo2``) at its highest during the measured step, polled
after every operator (a ``TorchDispatchMode``) and every 0.2 ms from a
thread, less the heap before the model was built: the shards, the
buffers pooled for the collectives and what the warm-up step left are
counted; beside it, the peak above the heap just before the measured step. The rules:

- ``default``: ``units=None``: one unit per decoder layer, and the modules
  beside the layers (the embedding, the final norm, the head) units of
  their own;
- ``layers, rest outside``: the decoder layers only; the embedding, norm
  and head outside every unit, gathered for the whole call;
- ``layers + root``: torchtitan's FSDP2 wrapping (each layer, then the
  root): the root a unit holding the embedding, norm and head;
- ``model, lm_head``: the default before it followed the model.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import freplicate as fr

from ._common import on_two_ranks
from ._shard_sides import MiB, heap, malloc_trim, sampled_peak

LLAMA: dict[str, Any] = {
    "vocab_size": 8000,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
BATCH, SEQ = 4, 128
LAYERS = [f"model.layers.{i}" for i in range(LLAMA["num_hidden_layers"])]
RULES: dict[str, list[str] | None] = {
    "default": None,
    "layers, rest outside": LAYERS,
    "layers + root": ["", *LAYERS],
    "model, lm_head": ["model", "lm_head"],
}


class _Poll(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        assert heap is not None
        self.top = heap()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.top = max(self.top, heap())  # type: ignore[misc]
        return out


def _measure(units: list[str] | None) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    gc.collect()
    malloc_trim()
    assert heap is not None
    base = heap()  # before anything of the model: the figure counts the shards and the pools too
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    full = fr.state(model)
    shards = {k: v.clone() for k, v in fr.distributed.shard(full.params).items()}
    buffers = {k: v.clone() for k, v in full.buffers.items()}
    with torch.device("meta"):
        twin = LlamaForCausalLM(LlamaConfig(**LLAMA))
    sharded = fr.distributed.apply_sharded
    del model, full
    ids = torch.randint(
        0, LLAMA["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1)
    )

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out, _ = sharded(twin, fr.State(p, buffers), input_ids=ids, units=units)
        logits = out.logits[:, :-1].reshape(-1, LLAMA["vocab_size"])
        return F.cross_entropy(logits, ids[:, 1:].reshape(-1))

    step = fr.grad_and_value(loss)
    step(shards)  # warm: plans, pools
    gc.collect()
    malloc_trim()
    start = heap()
    poll = _Poll()
    got: dict[str, Any] = {}

    def measured() -> None:
        with poll:
            got["grads_and_loss"] = step(shards)

    t0 = time.perf_counter()
    sampled = sampled_peak(measured)
    seconds = time.perf_counter() - t0
    value = got["grads_and_loss"][1]
    peak = max(poll.top, sampled)
    return {"peak": peak - base, "above": peak - start, "loss": float(value), "seconds": seconds}


def _body(units: list[str] | None) -> dict[str, Any]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _measure(units)


def main() -> None:
    if heap is None:
        raise SystemExit("needs glibc's mallinfo2")
    print(f"Llama {LLAMA}, batch {BATCH} x {SEQ}, 2 gloo ranks, rank 0")
    print(f"{'units':<22} {'peak heap (MiB)':>16} {'above the step start':>21} {'step (s)':>9}")
    for name, units in RULES.items():
        got = on_two_ranks(_body, units, pin=True, group_timeout=120.0, limit=600.0)
        print(
            f"{name:<22} {got['peak'] / MiB:>16.1f} {got['above'] / MiB:>21.1f} "
            f"{got['seconds']:>9.2f}  loss {got['loss']:.6f}"
        )


if __name__ == "__main__":
    main()
