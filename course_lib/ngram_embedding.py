r"""Hashed n-gram embeddings: a learned vector for each short run of tokens, added to the token's own.

A token embedding says which token sits at a position; a character-level model then spends its first
layer finding out which characters came just before. This module hands it that directly: for every
position :math:`i` and every :math:`n = 2 \dots` ``max_n``, the n-gram :math:`t_{i-n+1} \dots t_i` that
ends there is hashed into one of ``buckets`` rows of its own table, and those rows are added to the
token embedding. A lookup costs no matrix product, so the model learns local statistics for almost no
time per step. Hashing keeps the tables small whatever the vocabulary; two n-grams that share a row
share a vector, which a large enough table makes rare. Positions with fewer than :math:`n-1` tokens
before them use a last row of their own. The tables start at zero, so a fresh model is the model
without them. The same idea drives the "bigram hash" embeddings of the 2025 GPT speed runs and
DeepSeek's Engram (2026).
"""
from __future__ import annotations

import torch
from torch import nn

from . import _validate as validate

__all__ = ["HashedNgramEmbedding"]

# A rolling polynomial hash modulo a prime below 2^31, so that hash * _BASE stays inside int64.
_PRIME = 2_147_483_647
_BASE = 1_000_003


class HashedNgramEmbedding(nn.Module):
    """``max_n - 1`` tables (for n = 2 .. max_n) of ``buckets + 1`` rows of ``embed_dim``, summed per position."""

    def __init__(self, embed_dim: int, max_n: int, buckets: int):
        super().__init__()
        validate.positive_int("embed_dim", embed_dim)
        if isinstance(max_n, bool) or not isinstance(max_n, int) or max_n < 2:
            raise ValueError(f"max_n: expected an int >= 2 (2 embeds bigrams), got {validate.describe(max_n)}")
        self.max_n = max_n
        self.buckets = validate.positive_int("buckets", buckets)
        self.tables = nn.ModuleList(nn.Embedding(buckets + 1, embed_dim) for _ in range(2, max_n + 1))
        for table in self.tables:
            nn.init.zeros_(table.weight)

    def forward(self, idx: torch.Tensor, before: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids ``idx`` (N, L) -> (N, L, embed_dim).

        ``before`` (N, k), k < max_n, holds the tokens just before ``idx`` (with a KV cache, the end of
        what was already seen), so the n-grams that reach back over them count too.
        """
        validate.token_ids("idx", idx, dim=2)
        if before is not None:
            validate.token_ids("before", before, dim=2)
            if before.shape[0] != idx.shape[0] or before.shape[1] >= self.max_n:
                raise ValueError(f"before: expected the last tokens of the same {idx.shape[0]} sequences, at most "
                                 f"{self.max_n - 1} of them (N, k), got shape {tuple(before.shape)}")
        tokens = idx if before is None else torch.cat([before, idx], dim=1)   # (N, k + L)
        skip = tokens.shape[1] - idx.shape[1]
        total = torch.arange(tokens.shape[1], device=idx.device)              # position in tokens
        code = tokens.long()                                                  # hash of the 1-gram ending at each position
        out = 0
        for n, table in enumerate(self.tables, start=2):
            shifted = torch.nn.functional.pad(code[:, :-1], (1, 0))            # the (n-1)-gram ending one earlier
            code = (shifted * _BASE + tokens) % _PRIME                         # (N, k + L)
            row = torch.where(total >= n - 1, code % self.buckets, self.buckets)   # too near the start: the last row
            out = out + table(row[:, skip:])                                   # (N, L, embed_dim)
        return out

    def extra_repr(self) -> str:
        return f"n=2..{self.max_n}, buckets={self.buckets}"
