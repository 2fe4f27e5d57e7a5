"""What the GPT example trains: a corpus made in code, and a small character-level GPT.

The corpus is sentences from a little grammar, drawn with a seeded
``random.Random``, so every run and every machine has the same text and
nothing is downloaded. The model is a decoder-only transformer (pre-LayerNorm
blocks of causal self-attention and an MLP) whose output layer reuses the
input embedding's weight (tied embeddings). ``examples/gpt_train.py`` trains it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the bird", "a child", "the cook"]
_VERBS = ["sees", "likes", "chases", "finds", "follows", "hears", "draws", "wants"]
_OBJECTS = ["the ball", "a red fish", "the moon", "an apple", "the small boat", "a song"]
_ENDINGS = ["", " at night", " in the garden", " by the river", " every day", " again"]


def corpus(sentences: int = 4000, seed: int = 0) -> str:
    """``sentences`` sentences of the grammar, a few to a line: the same text for the same seed."""
    rng = random.Random(seed)
    lines, line = [], []
    for _ in range(sentences):
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
        line.append(" ".join(words) + rng.choice(_ENDINGS) + rng.choice([".", ".", "!", "?"]))
        if rng.random() < 0.3:
            lines.append(" ".join(line).capitalize())
            line = []
    lines.append(" ".join(line).capitalize())
    return "\n".join(lines) + "\n"


class Vocabulary:
    """The text's characters, each an integer id."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self._ids = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self._ids[c] for c in text], dtype=torch.int64)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64  # the longest context, in characters
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.1


class SelfAttention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.n_head, self.dropout = c.n_head, c.dropout
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            for z in self.qkv(x).split(c, dim=2)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.n_embd)
        self.attn = SelfAttention(c)
        self.ln2 = nn.LayerNorm(c.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(c.n_embd, 4 * c.n_embd),
            nn.GELU(),
            nn.Linear(4 * c.n_embd, c.n_embd),
            nn.Dropout(c.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``GPT(config)(ids) -> logits``: ids ``(batch, time)``, logits ``(batch, time, vocab)``.

    ``head.weight`` is ``tok.weight`` (tied): ``named_parameters()`` and
    ``fr.state`` hold it once, as ``tok.weight``; ``state_dict()`` has both names.
    """

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab_size, c.n_embd)
        self.pos = nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln = nn.LayerNorm(c.n_embd)
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        # GPT-2's initialisation: N(0, 0.02), and the projections into the
        # residual stream scaled down by the depth, so its variance does not grow
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            deep = name.endswith(("attn.proj.weight", "mlp.2.weight"))
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * c.n_layer) if deep else 0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.tok(ids) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def decayed(params: Mapping[str, torch.Tensor]) -> dict[str, bool]:
    """Which parameters AdamW decays, by the usual GPT convention (nanoGPT's, GPT-2's).

    Every tensor of two or more dimensions: the matrices of the linear layers
    and both embeddings (the token embedding is also the output layer). Not
    decayed: the biases and the LayerNorm weights and biases, all 1-D.
    (minGPT decays neither embedding; it is a choice, here nanoGPT's.)
    """
    return {k: p.dim() >= 2 for k, p in params.items()}
