"""Student attempts at the exercises of notebooks 04-07, correct and buggy, as students write them.

Each buggy attempt carries the diagnosis its checker must give (and, where the message matters,
words it must contain); each correct attempt must pass. The classes for 4.2 and 4.3 keep the
notebook's given constructor and only write ``forward``, as the exercise asks.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from course_lib.attention import MultiHeadMaskedAttention
from course_lib.model import GPT, FeedForward
from course_lib.train import lm_loss


@dataclass(frozen=True)
class Attempt:
    exercise: str
    name: str
    candidate: Any
    expected: str | None                 # the diagnosis code, None for a correct attempt
    says: tuple[str, ...] = ()           # words the message must contain (case-insensitive)
    kwargs: dict = field(default_factory=dict)   # extra checker arguments (norm_first=False)

    @property
    def id(self) -> str:
        return f"{self.exercise}-{self.name}"


BUGGY: list[Attempt] = []
CORRECT: list[Attempt] = []


def bug(exercise: str, expected: str, *says: str, **kwargs: Any) -> Callable[[Any], Any]:
    """Register a buggy function or class under its own name."""
    def register(candidate: Any) -> Any:
        BUGGY.append(Attempt(exercise, candidate.__name__, candidate, expected, says, kwargs))
        return candidate
    return register


def correct(exercise: str, **kwargs: Any) -> Callable[[Any], Any]:
    def register(candidate: Any) -> Any:
        CORRECT.append(Attempt(exercise, candidate.__name__, candidate, None, (), kwargs))
        return candidate
    return register


# ============================================================================ 4.1 sinusoidal_table

@correct("4.1")
def table_exp_log(max_tokens, embed_dim):
    pos = torch.arange(max_tokens).unsqueeze(1).float()
    div = torch.exp(torch.arange(0, embed_dim, 2).float() * (-math.log(10000.0) / embed_dim))
    pe = torch.zeros(max_tokens, embed_dim)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


@correct("4.1")
def table_python_loops(max_tokens, embed_dim):
    pe = torch.zeros(max_tokens, embed_dim)
    for pos in range(max_tokens):
        for i in range(0, embed_dim, 2):
            angle = pos / (10000 ** (i / embed_dim))
            pe[pos, i] = math.sin(angle)
            pe[pos, i + 1] = math.cos(angle)
    return pe


@correct("4.1")
def table_stack_numpy(max_tokens, embed_dim):
    pos = np.arange(max_tokens)[:, None]
    freq = 1.0 / 10000 ** (np.arange(0, embed_dim, 2) / embed_dim)
    angles = pos * freq
    return np.stack([np.sin(angles), np.cos(angles)], axis=-1).reshape(max_tokens, embed_dim)


@bug("4.1", "sincos_layout", "swapped")
def table_sin_cos_swapped(max_tokens, embed_dim):
    pos = torch.arange(max_tokens).unsqueeze(1).float()
    div = 10000 ** (torch.arange(0, embed_dim, 2).float() / embed_dim)
    pe = torch.zeros(max_tokens, embed_dim)
    pe[:, 0::2] = torch.cos(pos / div)
    pe[:, 1::2] = torch.sin(pos / div)
    return pe


@bug("4.1", "sincos_layout", "concatenated", "interleave")
def table_concat_halves(max_tokens, embed_dim):
    pos = torch.arange(max_tokens).unsqueeze(1).float()
    div = 10000 ** (torch.arange(0, embed_dim, 2).float() / embed_dim)
    return torch.cat([torch.sin(pos / div), torch.cos(pos / div)], dim=1)


@bug("4.1", "shape", "one row per position")
def table_transposed(max_tokens, embed_dim):
    pos = torch.arange(max_tokens).float()
    div = 10000 ** (torch.arange(0, embed_dim, 2).float() / embed_dim)
    angles = div[:, None] ** -1 * pos[None, :]          # (d/2, T)
    pe = torch.zeros(embed_dim, max_tokens)
    pe[0::2] = torch.sin(angles)
    pe[1::2] = torch.cos(angles)
    return pe


@bug("4.1", "scale", "base")
def table_base_1000(max_tokens, embed_dim):
    pos = torch.arange(max_tokens).unsqueeze(1).float()
    div = 1000 ** (torch.arange(0, embed_dim, 2).float() / embed_dim)
    pe = torch.zeros(max_tokens, embed_dim)
    pe[:, 0::2] = torch.sin(pos / div)
    pe[:, 1::2] = torch.cos(pos / div)
    return pe


@bug("4.1", "scale", "exponent")
def table_pair_index_exponent(max_tokens, embed_dim):
    pos = torch.arange(max_tokens).unsqueeze(1).float()
    i = torch.arange(embed_dim // 2).float()
    div = 10000 ** (i / embed_dim)           # forgot the 2 in 2i/d
    pe = torch.zeros(max_tokens, embed_dim)
    pe[:, 0::2] = torch.sin(pos / div)
    pe[:, 1::2] = torch.cos(pos / div)
    return pe


@bug("4.1", "scale", "divide")
def table_multiplies_by_frequency(max_tokens, embed_dim):
    pos = torch.arange(max_tokens).unsqueeze(1).float()
    div = 10000 ** (torch.arange(0, embed_dim, 2).float() / embed_dim)
    pe = torch.zeros(max_tokens, embed_dim)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


@bug("4.1", "positions", "start at 1")
def table_positions_from_one(max_tokens, embed_dim):
    pos = torch.arange(1, max_tokens + 1).unsqueeze(1).float()
    div = 10000 ** (torch.arange(0, embed_dim, 2).float() / embed_dim)
    pe = torch.zeros(max_tokens, embed_dim)
    pe[:, 0::2] = torch.sin(pos / div)
    pe[:, 1::2] = torch.cos(pos / div)
    return pe


@bug("4.1", "dtype", "float")
def table_integer_zeros(max_tokens, embed_dim):
    pos = torch.arange(max_tokens).unsqueeze(1)
    pe = torch.zeros_like(pos.expand(max_tokens, embed_dim))   # inherits torch.long from arange
    div = 10000 ** (torch.arange(0, embed_dim, 2) / embed_dim)
    pe[:, 0::2] = torch.sin(pos / div)
    pe[:, 1::2] = torch.cos(pos / div)
    return pe


@bug("4.1", "not_implemented")
def table_not_written(max_tokens, embed_dim):
    raise NotImplementedError("Exercise 4.1: write sinusoidal_table")


# ============================================================================ 4.2 TransformerBlock.forward

class GivenBlock(nn.Module):
    """The constructor notebook 04 gives; students write forward."""

    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(embed_dim)
        self.attn = MultiHeadMaskedAttention(embed_dim, num_heads, max_tokens, dropout_rate)
        self.ln2 = nn.LayerNorm(embed_dim)
        self.mlp = FeedForward(embed_dim, 4 * embed_dim, dropout_rate)


@correct("4.2")
class BlockPreNorm(GivenBlock):
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


@correct("4.2")
class BlockNamedSteps(GivenBlock):
    def forward(self, x, cache=None):
        # 1. attention on the normalised input, added to the residual stream
        h = self.ln1(x)
        attended = self.attn(h, cache)
        x = attended + x
        # 2. the same for the feed-forward network
        out = self.mlp(self.ln2(x))
        return x + out


@correct("4.2", norm_first=False)
class BlockPostNorm(GivenBlock):
    def forward(self, x):
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


@correct("4.2", norm_first=False)
class BlockBothWays(GivenBlock):
    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0, norm_first=True):
        super().__init__(embed_dim, num_heads, max_tokens, dropout_rate)
        self.norm_first = norm_first

    def forward(self, x):
        if self.norm_first:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


@bug("4.2", "norm_placement", "pre-norm")
class BlockWrotePostNorm(GivenBlock):
    def forward(self, x):
        x = self.ln1(x + self.attn(x))
        x = self.ln2(x + self.mlp(x))
        return x


@bug("4.2", "norm_placement", "post-norm", norm_first=False)
class BlockWrotePreNormForPost(GivenBlock):
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


@bug("4.2", "residual", "attention")
class BlockNoAttnResidual(GivenBlock):
    def forward(self, x):
        x = self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


@bug("4.2", "residual", "neither")
class BlockNoResiduals(GivenBlock):
    def forward(self, x):
        x = self.attn(self.ln1(x))
        x = self.mlp(self.ln2(x))
        return x


@bug("4.2", "residual", "normalised")
class BlockResidualOfNormalised(GivenBlock):
    def forward(self, x):
        x = self.ln1(x)
        x = x + self.attn(x)
        x = self.ln2(x)
        x = x + self.mlp(x)
        return x


@bug("4.2", "residual", norm_first=False)
class BlockPostNormNoMlpResidual(GivenBlock):
    def forward(self, x):
        x = self.ln1(x + self.attn(x))
        return self.ln2(self.mlp(x))


@bug("4.2", "norm_placement", "swapped")
class BlockLayerNormsSwapped(GivenBlock):
    def forward(self, x):
        x = x + self.attn(self.ln2(x))
        x = x + self.mlp(self.ln1(x))
        return x


@bug("4.2", "sublayer_missing", "feed-forward")
class BlockForgotMlp(GivenBlock):
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        self.mlp(self.ln2(x))
        return x


@bug("4.2", "residual", "parallel")
class BlockParallelSublayers(GivenBlock):
    def forward(self, x):
        return x + self.attn(self.ln1(x)) + self.mlp(self.ln2(x))


@bug("4.2", "norm_placement", "both")
class BlockNormTwice(GivenBlock):
    def forward(self, x):
        x = self.ln1(x + self.attn(self.ln1(x)))
        x = self.ln2(x + self.mlp(self.ln2(x)))
        return x


@bug("4.2", "dropout", "eval")
class BlockExtraDropout(GivenBlock):
    def forward(self, x):
        x = x + F.dropout(self.attn(self.ln1(x)), 0.1)
        x = x + F.dropout(self.mlp(self.ln2(x)), 0.1)
        return x


@bug("4.2", "causal_mask", "future")
class BlockNormOverSequence(GivenBlock):
    def forward(self, x):
        # "layer norm" over the whole (L, E) slice: every position sees the statistics of the future
        h = F.layer_norm(x, x.shape[1:])
        x = x + self.attn(h)
        x = x + self.mlp(self.ln2(x))
        return x


@bug("4.2", "shape", "return")
class BlockForgotReturn(GivenBlock):
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))


@bug("4.2", "mismatch", "query.weight")
class BlockRenamedAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(embed_dim)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads, dropout=dropout_rate, bias=False,
                                          batch_first=True)
        self.ln2 = nn.LayerNorm(embed_dim)
        self.mlp = FeedForward(embed_dim, 4 * embed_dim, dropout_rate)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


# ============================================================================ 4.3 GPT.forward
# The given constructor is course_lib's: students subclass nothing else and write forward.

@correct("4.3")
class GPTLoop(GPT):
    def forward(self, idx, cache=None):
        n, length = idx.shape
        if length > self.config.max_tokens:
            raise ValueError(f"sequence of {length} tokens is longer than max_tokens={self.config.max_tokens}")
        start = cache[0].length if cache else 0
        x = self.token_embedding(idx) + self.position_encoding(length, start)
        x = self.dropout(x)
        for i, block in enumerate(self.blocks):
            x = block(x, None if cache is None else cache[i])
        return self.head(self.ln_f(x))


@correct("4.3")
class GPTNoCache(GPT):
    def forward(self, idx):
        tokens = self.token_embedding(idx)                        # (N, L, E)
        positions = self.position_encoding(idx.size(1))           # (L, E), raises past max_tokens
        x = self.dropout(tokens + positions.unsqueeze(0))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.head(x)


@correct("4.3")
class GPTCacheLeftForLater(GPT):
    def forward(self, idx, cache=None):
        if cache is not None:
            raise NotImplementedError("Exercise 4.3: the cache comes in notebook 06")
        x = self.token_embedding(idx) + self.position_encoding(idx.shape[1])
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@correct("4.3")
class GPTIgnoresCache(GPT):
    def forward(self, idx, cache=None):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[-1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@bug("4.3", "positions", "positions")
class GPTNoPositions(GPT):
    def forward(self, idx, cache=None):
        if idx.shape[1] > self.config.max_tokens:
            raise ValueError("too long")
        x = self.dropout(self.token_embedding(idx))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@bug("4.3", "final_norm", "ln_f")
class GPTNoFinalNorm(GPT):
    def forward(self, idx, cache=None):
        x = self.token_embedding(idx) + self.position_encoding(idx.shape[1])
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@bug("4.3", "logits", "logits, not probabilities")
class GPTReturnsProbabilities(GPT):
    def forward(self, idx, cache=None):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.softmax(logits, dim=-1)


@bug("4.3", "logits", "logits")
class GPTReturnsLogProbabilities(GPT):
    def forward(self, idx, cache=None):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.log_softmax(self.head(self.ln_f(x)), dim=-1)


@bug("4.3", "scale", "sqrt")
class GPTScaledEmbeddings(GPT):
    def forward(self, idx, cache=None):
        x = self.token_embedding(idx) * math.sqrt(self.config.embed_dim)
        x = self.dropout(x + self.position_encoding(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@bug("4.3", "block_chain", "previous block")
class GPTBlocksFromEmbeddings(GPT):
    def forward(self, idx, cache=None):
        emb = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        for block in self.blocks:
            x = block(emb)
        return self.head(self.ln_f(x))


@bug("4.3", "dropout", "eval")
class GPTFunctionalDropout(GPT):
    def forward(self, idx, cache=None):
        x = F.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]), 0.1)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@bug("4.3", "shape", "head")
class GPTForgotHead(GPT):
    def forward(self, idx, cache=None):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


@bug("4.3", "positions", "positions", "cache")
class GPTCachePositionsFromZero(GPT):
    def forward(self, idx, cache=None):
        x = self.token_embedding(idx) + self.position_encoding(idx.shape[1])   # always from position 0
        x = self.dropout(x)
        for i, block in enumerate(self.blocks):
            x = block(x, cache[i] if cache is not None else None)
        return self.head(self.ln_f(x))


@bug("4.3", "causal_mask", "future")
class GPTFinalNormOverSequence(GPT):
    def forward(self, idx, cache=None):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        # normalises each sequence as a whole, so statistics of later tokens reach earlier ones
        x = F.layer_norm(x, x.shape[1:])
        return self.head(x)


@bug("4.3", "dtype", "tuple")
class GPTReturnsLogitsAndLoss(GPT):
    def forward(self, idx, targets=None):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


@bug("4.3", "context_limit", "max_tokens")
class GPTSilentCrop(GPT):
    def forward(self, idx, cache=None):
        idx = idx[:, -self.config.max_tokens:]     # quietly drops the oldest tokens
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ============================================================================ 5.1 lm_windows

@bug("5.1", "dtype", "long")   # refiled: the windows are torch.long whatever the ids' dtype (round 34)
def windows_unfold(ids, max_tokens):
    chunks = ids.unfold(0, max_tokens + 1, max_tokens)
    return chunks[:, :-1], chunks[:, 1:]


@correct("5.1")
def windows_unfold_as_long(ids, max_tokens):
    chunks = ids.long().unfold(0, max_tokens + 1, max_tokens)   # (windows, max_tokens + 1)
    return chunks[:, :-1], chunks[:, 1:]


@bug("5.1", "dtype", "long")   # refiled: the windows are torch.long whatever the ids' dtype (round 34)
def windows_loop(ids, max_tokens):
    inputs, targets = [], []
    for start in range(0, len(ids) - max_tokens, max_tokens):
        inputs.append(ids[start:start + max_tokens])
        targets.append(ids[start + 1:start + max_tokens + 1])
    return torch.stack(inputs), torch.stack(targets)


@bug("5.1", "dtype", "long")   # refiled: the windows are torch.long whatever the ids' dtype (round 34)
def windows_with_stride(ids, max_tokens, stride=None):
    stride = stride or max_tokens
    starts = range(0, len(ids) - max_tokens, stride)
    x = torch.stack([ids[s:s + max_tokens] for s in starts])
    y = torch.stack([ids[s + 1:s + 1 + max_tokens] for s in starts])
    return x, y


@bug("5.1", "target_shift", "next")
def windows_targets_not_shifted(ids, max_tokens):
    chunks = ids[: len(ids) // max_tokens * max_tokens].view(-1, max_tokens)
    return chunks, chunks.clone()


@bug("5.1", "target_shift", "wrong way")
def windows_shifted_backwards(ids, max_tokens):
    inputs, targets = [], []
    for start in range(0, len(ids) - max_tokens, max_tokens):
        inputs.append(ids[start + 1:start + max_tokens + 1])
        targets.append(ids[start:start + max_tokens])
    return torch.stack(inputs), torch.stack(targets)


@bug("5.1", "shape", "max_tokens + 1")
def windows_too_long(ids, max_tokens):
    inputs, targets = [], []
    for start in range(0, len(ids) - max_tokens - 1, max_tokens):
        inputs.append(ids[start:start + max_tokens + 1])
        targets.append(ids[start + 1:start + max_tokens + 2])
    return torch.stack(inputs), torch.stack(targets)


@bug("5.1", "overlapping_windows", "overlap")
def windows_every_token(ids, max_tokens):
    inputs = torch.stack([ids[i:i + max_tokens] for i in range(len(ids) - max_tokens)])
    targets = torch.stack([ids[i + 1:i + max_tokens + 1] for i in range(len(ids) - max_tokens)])
    return inputs, targets


@bug("5.1", "shape", "max_tokens + 1")
def windows_reshape_chunks(ids, max_tokens):
    usable = len(ids) // (max_tokens + 1) * (max_tokens + 1)
    chunks = ids[:usable].view(-1, max_tokens + 1)
    return chunks[:, :-1], chunks[:, 1:]


@bug("5.1", "shape", "fits")
def windows_last_one_dropped(ids, max_tokens):
    inputs, targets = [], []
    for start in range(0, len(ids) - max_tokens - 1, max_tokens):
        inputs.append(ids[start:start + max_tokens])
        targets.append(ids[start + 1:start + max_tokens + 1])
    return torch.stack(inputs), torch.stack(targets)


@bug("5.1", "dtype", "long")
def windows_float_tensor(ids, max_tokens):
    values = ids.tolist()
    rows = [values[s:s + max_tokens + 1] for s in range(0, len(values) - max_tokens, max_tokens)]
    chunks = torch.tensor(rows, dtype=torch.float32)
    return chunks[:, :-1], chunks[:, 1:]


@bug("5.1", "dtype", "torch.Tensor")
def windows_python_lists(ids, max_tokens):
    values = ids.tolist()
    starts = range(0, len(values) - max_tokens, max_tokens)
    return [values[s:s + max_tokens] for s in starts], [values[s + 1:s + max_tokens + 1] for s in starts]


# ============================================================================ 5.2 lm_loss

@correct("5.2")
def loss_flatten(logits, targets):
    n, length, vocab = logits.shape
    return F.cross_entropy(logits.view(n * length, vocab), targets.view(n * length))


@correct("5.2")
def loss_transpose(logits, targets):
    return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100)


@correct("5.2")
def loss_manual(logits, targets):
    logp = F.log_softmax(logits, dim=-1)
    keep = targets != -100
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(picked * keep).sum() / keep.sum()


@correct("5.2")
def loss_nll_of_log_softmax(logits, targets):
    return F.nll_loss(F.log_softmax(logits, -1).reshape(-1, logits.size(-1)), targets.reshape(-1))


@bug("5.2", "logits", "softmax")
def loss_softmax_first(logits, targets):
    probs = F.softmax(logits, dim=-1)
    return F.cross_entropy(probs.view(-1, probs.size(-1)), targets.view(-1))


@bug("5.2", "shape", "dimension 1")
def loss_not_flattened(logits, targets):
    return F.cross_entropy(logits, targets)


@bug("5.2", "shape", "flatten")
def loss_only_logits_flattened(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets)


@bug("5.2", "loss_reduction", "sum")
def loss_summed(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


@bug("5.2", "loss_reduction", "padding")
def loss_mean_over_all_positions(logits, targets):
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return per_token.mean()


@bug("5.2", "loss_reduction", "-100")
def loss_gather_without_mask(logits, targets):
    logp = F.log_softmax(logits, dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).mean()


@bug("5.2", "logits", "log-probabilities")
def loss_nll_on_logits(logits, targets):
    return F.nll_loss(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@bug("5.2", "dtype", ".item()")
def loss_item(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


@bug("5.2", "shape", "mean")
def loss_per_token(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")


@bug("5.2", "loss_reduction", "sequence")
def loss_mean_of_sequence_means(logits, targets):
    return torch.stack([F.cross_entropy(l, t) for l, t in zip(logits, targets)]).mean()


# ============================================================================ 5.3 train_step

@correct("5.3")
def step_classic(model, optimizer, inputs, targets, max_grad_norm=1.0):
    model.train()
    optimizer.zero_grad()
    logits = model(inputs)
    loss = lm_loss(logits, targets)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


# the text: "PyTorch adds new gradients to old ones, so clear them first" (refiled in round 42: gradients the model
# already held when the step is called go into its update)
@bug("5.3", "zero_grad", "START")
def step_clip_and_zero_at_end(model, optimizer, inputs, targets, max_grad_norm=1.0):
    model.train()
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss)


@correct("5.3")
def step_returns_tensor(model, optimizer, inputs, targets, max_grad_norm=1.0):
    model.train()
    model.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm is not None:   # clip by hand: scale every gradient by the same factor
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None))
        scale = min(1.0, max_grad_norm / (float(norm) + 1e-6))
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    optimizer.step()
    return loss.detach()


@bug("5.3", "zero_grad", "zero_grad")
def step_no_zero_grad(model, optimizer, inputs, targets):
    model.train()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.item()


@bug("5.3", "step_order", "optimizer.step()")
def step_no_step(model, optimizer, inputs, targets):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    return loss.item()


@bug("5.3", "step_order", "loss.backward()")
def step_no_backward(model, optimizer, inputs, targets):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    optimizer.step()
    return loss.item()


@bug("5.3", "zero_grad", "cleared")
def step_zero_grad_before_step(model, optimizer, inputs, targets):
    model.train()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    optimizer.zero_grad()
    optimizer.step()
    return loss.item()


@bug("5.3", "step_order", "after loss.backward()")
def step_step_before_backward(model, optimizer, inputs, targets):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    optimizer.step()
    loss.backward()
    return loss.item()


@bug("5.3", "dropout", "model.train()")
def step_never_train_mode(model, optimizer, inputs, targets):
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.item()


@bug("5.3", "dtype", "return")
def step_no_return(model, optimizer, inputs, targets):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()


@bug("5.3", "step_order", "more than once")
def step_backward_twice(model, optimizer, inputs, targets):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward(retain_graph=True)
    loss.backward()
    optimizer.step()
    return loss.item()


@bug("5.3", "step_order", "before the update")
def step_returns_loss_after_update(model, optimizer, inputs, targets):
    model.train()
    optimizer.zero_grad()
    lm_loss(model(inputs), targets).backward()
    optimizer.step()
    with torch.no_grad():
        return lm_loss(model(inputs), targets).item()


@bug("5.3", "clipping", "not clipped")
def step_forgets_to_clip(model, optimizer, inputs, targets, max_grad_norm=1.0):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.item()


@bug("5.3", "clipping", "not clipped")
def step_clips_before_backward(model, optimizer, inputs, targets, max_grad_norm=1.0):
    model.train()
    optimizer.zero_grad()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)   # nothing to clip yet
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.item()


@bug("5.3", "clipping", "fixed number")
def step_clips_to_a_constant(model, optimizer, inputs, targets, max_grad_norm=1.0):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    optimizer.step()
    return loss.item()


@bug("5.3", "clipping", "max_grad_norm")
def step_without_the_parameter(model, optimizer, inputs, targets):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.item()


# ============================================================================ 5.4 sample_next_token

@correct("5.4")
def sample_classic(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, top_k)
        logits[logits < v[:, [-1]]] = -float("inf")
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


# wrong since round 35d: the noise is drawn on the CPU (no device=), so logits on a GPU meet CPU noise (the text
# asks for new tensors on the logits' device)
@bug("5.4", "device")
def sample_gumbel_max(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits / temperature
    if top_k:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    uniform = torch.rand(scaled.shape, generator=generator).clamp_min(1e-20)
    return (scaled - torch.log(-torch.log(uniform))).argmax(-1)


@correct("5.4")
def sample_sorted_rows(logits, temperature=1.0, top_k=None, generator=None):
    out = []
    for row in logits:
        if temperature == 0:
            out.append(row.argmax())
            continue
        probs = torch.softmax(row / temperature, dim=0)
        if top_k is not None:
            order = probs.argsort(descending=True)
            probs[order[top_k:]] = 0.0
            probs = probs / probs.sum()
        out.append(torch.multinomial(probs, 1, generator=generator)[0])
    return torch.stack(out).long()


@bug("5.4", "greedy", "randomness")
def sample_always_argmax(logits, temperature=1.0, top_k=None, generator=None):
    return (logits / max(temperature, 1e-8)).argmax(-1)


@bug("5.4", "normalization", "softmax")
def sample_raw_logits(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(logits / temperature, 1, generator=generator).squeeze(-1)


@bug("5.4", "softmax_dim", "dim=-1")
def sample_softmax_dim0(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    probs = F.softmax(logits / temperature, dim=0)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@bug("5.4", "scale", "divide")
def sample_temperature_multiplied(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    probs = F.softmax(logits * temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@bug("5.4", "scale", "before the softmax")
def sample_temperature_after_softmax(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    probs = F.softmax(logits, dim=-1) / temperature
    if top_k is not None:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@bug("5.4", "top_k", "-inf")
def sample_topk_fill_zero(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, 0.0)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("5.4", "top_k", "top_k has no effect")
def sample_topk_ignored(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@bug("5.4", "top_k", "keep 4 tokens instead of top_k=3")
def sample_topk_keeps_one_more(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        sorted_logits = logits.sort(dim=-1, descending=True).values
        threshold = sorted_logits[:, top_k]               # index top_k is the (k+1)-th largest
        logits = logits.masked_fill(logits < threshold[:, None], float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("5.4", "top_k", "keep 2 tokens instead of top_k=3")
def sample_topk_strict_threshold(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k).values[:, -1:]
        logits = logits.masked_fill(logits <= kth, float("-inf")) if top_k > 1 else logits
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("5.4", "top_k", "least likely")
def sample_topk_smallest(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        values, indices = torch.topk(logits, top_k, largest=False)
        logits = torch.full_like(logits, float("-inf")).scatter(-1, indices, values)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("5.4", "shape", "squeeze")
def sample_keeps_last_dim(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    return torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)


@bug("5.4", "exception", "temperature=0")
def sample_divides_by_zero(logits, temperature=1.0, top_k=None, generator=None):
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@bug("5.4", "generator", "generator")
def sample_ignores_generator(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.distributions.Categorical(logits=logits).sample()


@bug("5.4", "shape", ".squeeze(-1)")
def sample_squeezes_everything(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, top_k)
        logits[logits < v[:, [-1]]] = float("-inf")
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze()   # (N,) ... or () when N = 1


@bug("5.4", "generator", "global")
def sample_reseeds_from_the_generator(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if generator is not None:
        torch.manual_seed(generator.initial_seed())   # reproducible, but through the global RNG
    return torch.multinomial(logits.softmax(-1), 1).squeeze(-1)


@correct("5.4")
def sample_float64_loop(logits, temperature=1.0, top_k=None, generator=None):
    out = []
    for row in logits.double():                       # one row at a time, in float64
        if temperature == 0:
            out.append(int(row.argmax()))
            continue
        row = row / temperature
        if top_k is not None:
            row = row.masked_fill(row < row.topk(top_k).values[-1], float("-inf"))
        out.append(int(torch.multinomial(row.softmax(0), 1, generator=generator)))
    return torch.tensor(out, dtype=torch.long)


# ============================================================================ 6.1 flops_per_token

@correct("6.1")
def flops_formula(config, num_weights):
    return 6 * num_weights + 12 * config.num_layers * config.num_heads * config.head_dim * config.max_tokens


@correct("6.1")
def flops_with_embed_dim(config, num_weights):
    # H·Q is embed_dim
    return 6 * num_weights + 12 * config.num_layers * config.embed_dim * config.max_tokens


@correct("6.1")
def flops_forward_times_three(config, num_weights):
    forward = 2 * num_weights + 2 * 2 * config.num_layers * config.num_heads * config.head_dim * config.max_tokens
    return 3 * forward   # backward is twice the forward


@correct("6.1")
def flops_as_float_tensor(config, num_weights):
    per_layer = torch.tensor(12.0 * config.embed_dim * config.max_tokens)
    return 6.0 * num_weights + config.num_layers * per_layer


@correct("6.1")
def flops_as_numpy(config, num_weights):
    return np.int64(6 * num_weights) + np.int64(12 * config.num_layers * config.embed_dim * config.max_tokens)


@bug("6.1", "flops_factor", "forward pass only")
def flops_forward_only(config, num_weights):
    return 2 * num_weights + 4 * config.num_layers * config.num_heads * config.head_dim * config.max_tokens


@bug("6.1", "flops_factor", "2N", "6N")
def flops_weights_forward_only(config, num_weights):
    return 2 * num_weights + 12 * config.num_layers * config.num_heads * config.head_dim * config.max_tokens


@bug("6.1", "flops_factor", "dL/dW")
def flops_four_n(config, num_weights):
    return 4 * num_weights + 12 * config.num_layers * config.num_heads * config.head_dim * config.max_tokens


@bug("6.1", "attention_flops", "not attention")
def flops_weights_only(config, num_weights):
    return 6 * num_weights


@bug("6.1", "flops_factor", "only the forward pass", "12·n·H·Q·T")
def flops_attention_forward_only(config, num_weights):
    return 6 * num_weights + 4 * config.num_layers * config.num_heads * config.head_dim * config.max_tokens


@bug("6.1", "attention_flops", "weighted sum")
def flops_attention_one_product(config, num_weights):
    return 6 * num_weights + 6 * config.num_layers * config.num_heads * config.head_dim * config.max_tokens


@bug("6.1", "attention_flops", "number of heads")
def flops_no_heads(config, num_weights):
    return 6 * num_weights + 12 * config.num_layers * config.head_dim * config.max_tokens


@bug("6.1", "attention_flops", "head_dim")
def flops_embed_dim_per_head(config, num_weights):
    return 6 * num_weights + 12 * config.num_layers * config.num_heads * config.embed_dim * config.max_tokens


@bug("6.1", "attention_flops", "number of layers")
def flops_no_layers(config, num_weights):
    return 6 * num_weights + 12 * config.num_heads * config.head_dim * config.max_tokens


@bug("6.1", "attention_flops", "T twice")
def flops_context_squared(config, num_weights):
    return 6 * num_weights + 12 * config.num_layers * config.embed_dim * config.max_tokens ** 2


@bug("6.1", "flops_units", "whole window")
def flops_per_window(config, num_weights):
    return (6 * num_weights + 12 * config.num_layers * config.embed_dim * config.max_tokens) * config.max_tokens


@bug("6.1", "flops_units", "GFLOPs")
def flops_in_gflops(config, num_weights):
    return (6 * num_weights + 12 * config.num_layers * config.embed_dim * config.max_tokens) / 1e9


@bug("6.1", "weights_count", "num_weights argument")
def flops_counts_its_own_weights(config, num_weights):
    n = 12 * config.num_layers * config.embed_dim ** 2   # the blocks only, ignoring the argument
    return 6 * n + 12 * config.num_layers * config.embed_dim * config.max_tokens


@bug("6.1", "attention_flops", "expected")
def flops_vocab_in_attention(config, num_weights):
    return 6 * num_weights + 12 * config.num_layers * config.embed_dim * config.vocab_size


@bug("6.1", "dtype", "forget `return`")
def flops_prints_instead_of_returning(config, num_weights):
    print(6 * num_weights + 12 * config.num_layers * config.embed_dim * config.max_tokens)


@bug("6.1", "dtype", "str")
def flops_formatted_string(config, num_weights):
    return f"{6 * num_weights + 12 * config.num_layers * config.embed_dim * config.max_tokens:,}"


@bug("6.1", "exception", "AttributeError")
def flops_wrong_attribute(config, num_weights):
    return 6 * num_weights + 12 * config.n_layer * config.n_head * config.head_dim * config.max_tokens


# ============================================================================ 6.2 generate_with_cache

@correct("6.2")
@torch.no_grad()
def cached_classic(model, idx, max_new_tokens):
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        next_id = logits[:, -1, :].argmax(dim=-1, keepdim=True)
        idx = torch.cat((idx, next_id), dim=1)
        logits = model(next_id, cache)     # one forward more than needed: harmless
    return idx


@correct("6.2")
def cached_token_by_token(model, idx, max_new_tokens):
    cache = model.new_cache()
    out = idx
    with torch.no_grad():
        for t in range(idx.shape[1]):                  # the prompt, one token at a time
            logits = model(idx[:, t:t + 1], cache=cache)
        for step in range(max_new_tokens):
            token = logits[:, -1].argmax(-1)
            out = torch.cat([out, token[:, None]], dim=1)
            if step < max_new_tokens - 1:
                logits = model(token[:, None], cache=cache)
    return out


@bug("6.2", "exception", "whole sequence")
def cached_refeeds_everything(model, idx, max_new_tokens):
    cache = model.new_cache()
    for _ in range(max_new_tokens):
        logits = model(idx, cache)
        next_id = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, next_id], dim=1)
    return idx


@bug("6.2", "no_kv_cache", "new cache")
def cached_new_cache_every_step(model, idx, max_new_tokens):
    logits = model(idx, model.new_cache())
    for _ in range(max_new_tokens):
        next_id = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, next_id], dim=1)
        logits = model(next_id, model.new_cache())
    return idx


@bug("6.2", "no_kv_cache", "never pass a cache")
def cached_without_cache(model, idx, max_new_tokens):
    for _ in range(max_new_tokens):
        logits = model(idx)
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


@bug("6.2", "no_kv_cache", "without the cache")
def cached_forgets_cache_later(model, idx, max_new_tokens):
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        next_id = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, next_id], dim=1)
        logits = model(next_id)
    return idx


@bug("6.2", "positions", "position 0")
def cached_positions_not_offset(model, idx, max_new_tokens):
    # their own forward for the new token, to "save" the position lookup
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        next_id = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, next_id], dim=1)
        x = model.token_embedding(next_id) + model.position_encoding(1)
        for block, layer_cache in zip(model.blocks, cache):
            x = block(x, layer_cache)
        logits = model.head(model.ln_f(x))
    return idx


@bug("6.2", "shape", "prompt unchanged")
def cached_collects_but_returns_prompt(model, idx, max_new_tokens):
    cache = model.new_cache()
    logits = model(idx, cache)
    generated = []
    for _ in range(max_new_tokens):
        next_id = logits[:, -1].argmax(-1, keepdim=True)
        generated.append(next_id)
        logits = model(next_id, cache)
    return idx


@bug("6.2", "shape", "only the")
def cached_returns_new_tokens_only(model, idx, max_new_tokens):
    cache = model.new_cache()
    logits = model(idx, cache)
    new = []
    for _ in range(max_new_tokens):
        next_id = logits[:, -1].argmax(-1, keepdim=True)
        new.append(next_id)
        logits = model(next_id, cache)
    return torch.cat(new, dim=1)


@bug("6.2", "shape", "exactly")
def cached_one_short(model, idx, max_new_tokens):
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens - 1):
        next_id = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, next_id], dim=1)
        logits = model(next_id, cache)
    return idx


@bug("6.2", "greedy", "differ")
def cached_samples_instead(model, idx, max_new_tokens):
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        next_id = torch.multinomial(logits[:, -1].softmax(-1), 1)
        idx = torch.cat([idx, next_id], dim=1)
        logits = model(next_id, cache)
    return idx


# ============================================================================ 7.1 split_c_attn

@correct("7.1")
def split_then_transpose(weight):
    embed_dim = weight.shape[0]
    wq, wk, wv = weight.split(embed_dim, dim=1)
    return wq.T, wk.T, wv.T


@correct("7.1")
def split_transpose_first(weight):
    return tuple(weight.t().chunk(3, dim=0))


@correct("7.1")
def split_slices(weight):
    e = weight.shape[0]
    return [weight[:, i * e:(i + 1) * e].t().contiguous() for i in range(3)]


@bug("7.1", "split_transpose", "transpose")
def split_no_transpose(weight):
    return weight.split(weight.shape[0], dim=1)


@bug("7.1", "mismatch", "order")
def split_key_first(weight):
    wk, wq, wv = weight.split(weight.shape[0], dim=1)    # thought the key came first
    return wq.T, wk.T, wv.T


@bug("7.1", "shape", "last dimension")
def split_rows(weight):
    q, k, v = weight.chunk(3, dim=0)
    return q, k, v


@bug("7.1", "mismatch", "every third")
def split_interleaved(weight):
    e = weight.shape[0]
    return tuple(weight.view(e, e, 3).permute(2, 1, 0))


# ============================================================================ 7.2 attention for transformers

@correct("7.2")
def hf_attention_matmul(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = query @ key.transpose(-2, -1) * scaling
    if attention_mask is None:
        lq, lk = scores.shape[-2:]                  # the queries are the last lq of the lk positions
        attention_mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(diagonal=lk - lq)
    scores = scores.masked_fill(~attention_mask, float("-inf"))
    weights = F.dropout(scores.softmax(dim=-1), p=dropout, training=module.training)
    return (weights @ value).transpose(1, 2), weights


@correct("7.2")
def hf_attention_sdpa_with_cache(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    lq, lk = query.shape[2], key.shape[2]
    if attention_mask is None and lq != lk:     # is_causal aligns top-left: build the cached case's mask
        attention_mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(diagonal=lk - lq)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         is_causal=attention_mask is None and lq > 1, scale=scaling)
    return out.transpose(1, 2), None


@correct("7.2")
def hf_attention_loop_float64(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    n, heads, lq, d = query.shape
    lk = key.shape[2]
    scale = d ** -0.5 if scaling is None else scaling
    out = torch.zeros(n, lq, heads, d, dtype=torch.float64, device=query.device)
    for i in range(lq):
        scores = (key.double() @ query[:, :, i, :, None].double()).squeeze(-1) * scale     # (N, heads, Lk)
        if attention_mask is None:
            scores[..., i + (lk - lq) + 1:] = float("-inf")   # position of query i is i + (lk - lq)
        else:
            scores = scores.masked_fill(~attention_mask[:, :, i, :], float("-inf"))
        out[:, i] = (scores.softmax(-1).unsqueeze(-2) @ value.double()).squeeze(-2)     # (N, heads, d)
    return out.to(query.dtype), None


@bug("7.2", "causal_mask", "top-left")
def hf_attention_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         is_causal=attention_mask is None and query.shape[2] > 1,
                                         scale=scaling)
    return out.transpose(1, 2).contiguous(), None


@bug("7.2", "causal_mask", "causality yourself")
def hf_attention_mask_ignored(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    weights = torch.softmax(query @ key.transpose(-1, -2) * scaling, dim=-1)
    return (weights @ value).transpose(1, 2), weights


@bug("7.2", "shape", "(N, L, heads, head_dim)")
def hf_attention_no_transpose(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                         is_causal=attention_mask is None, scale=scaling)
    return out, None


@bug("7.2", "softmax_dim", "dim -1")
def hf_attention_softmax_queries(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    scores = query @ key.transpose(-2, -1) * scaling
    mask = attention_mask if attention_mask is not None else torch.ones(
        scores.shape[-2:], dtype=torch.bool).tril()
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-2)
    return (weights @ value).transpose(1, 2), weights


@bug("7.2", "scale", "scaling")
def hf_attention_own_scale(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                         is_causal=attention_mask is None and query.shape[2] > 1)
    return out.transpose(1, 2), None


@bug("7.2", "causal_mask", "bool")
def hf_attention_adds_mask(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    scores = query @ key.transpose(-2, -1) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask          # eager's convention, but this mask is bool
    else:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    weights = scores.softmax(-1)
    return (weights @ value).transpose(1, 2), weights


@bug("7.2", "dtype", "tuple")
def hf_attention_returns_output_only(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                     **kwargs):
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                         is_causal=attention_mask is None, scale=scaling)
    return out.transpose(1, 2)


@bug("7.2", "dropout", "dropout")
def hf_attention_fixed_dropout(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.1,
                                         is_causal=attention_mask is None and query.shape[2] > 1, scale=scaling)
    return out.transpose(1, 2), None


# ============================================================================ issue 11: inputs changed in place

@bug("4.2", "mutation", "in place")
class BlockInPlaceResidual(GivenBlock):
    def forward(self, x):
        x += self.attn(self.ln1(x))             # overwrites the caller's x (and what ln1 saved for backward)
        x += self.mlp(self.ln2(x))
        return x


@bug("4.2", "gradient", "in-place")
class BlockInPlaceOnItsOwnTensor(GivenBlock):
    def forward(self, x):
        h = x + self.attn(self.ln1(x))          # a new tensor, so the forward is right ...
        h += self.mlp(self.ln2(h))              # ... but ln2 saved h for backward: loss.backward() fails
        return h


@bug("4.3", "mutation", "in place")
class GPTZeroesItsInput(GPT):
    def forward(self, idx):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.size(1)))
        idx.zero_()                              # "done with the ids"
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ============================================================================ issue 11: GPT dropout in training mode

@bug("4.3", "dropout", "logits")
class GPTDropoutOnLogits(GPT):
    def forward(self, idx):
        x = self.token_embedding(idx) + self.position_encoding(idx.size(1))
        for block in self.blocks:
            x = block(x)
        return self.dropout(self.head(self.ln_f(x)))                # dropout in the wrong place


@bug("4.3", "dropout", "after the embeddings")
class GPTForgetsEmbeddingDropout(GPT):
    def forward(self, idx):
        x = self.token_embedding(idx) + self.position_encoding(idx.size(1))   # (N, L, E), no dropout
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@correct("4.3")
class GPTFunctionalDropoutWithCheck(GPT):
    def forward(self, idx):
        n, length = idx.shape
        if length > self.config.max_tokens:
            raise ValueError(f"{length} tokens > max_tokens={self.config.max_tokens}")
        x = self.token_embedding(idx) + self.position_encoding(length)[None]    # (N, L, E)
        x = F.dropout(x, self.config.dropout_rate, training=self.training)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ============================================================================ issue 20: code that cannot learn

@bug("4.2", "gradient", "residual", "x")
class BlockDetachedResidual(GivenBlock):
    def forward(self, x):
        x = x.detach() + self.attn(self.ln1(x))      # "the residual is just a copy"
        return x + self.mlp(self.ln2(x))


@bug("4.2", "gradient", "mlp.")
class BlockMlpUnderNoGrad(GivenBlock):
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        with torch.no_grad():
            update = self.mlp(self.ln2(x))
        return x + update


@bug("4.2", "gradient", "ln1.weight")
class BlockLayerNormWeightDetached(GivenBlock):
    def forward(self, x):
        normed = F.layer_norm(x, x.shape[-1:], self.ln1.weight.detach(), self.ln1.bias, self.ln1.eps)
        x = x + self.attn(normed)
        return x + self.mlp(self.ln2(x))


@correct("4.2")
class BlockFunctionalLayerNorm(GivenBlock):
    def forward(self, x):
        eps = self.ln1.eps
        h = F.layer_norm(x, (x.shape[-1],), self.ln1.weight, self.ln1.bias, eps)
        x = torch.add(x, self.attn(h))
        return x + self.mlp(F.layer_norm(x, (x.shape[-1],), self.ln2.weight, self.ln2.bias, eps))


@bug("4.2", "norm_placement", "output")
class BlockNormOnSublayerOutput(GivenBlock):
    def forward(self, x):
        x = x + self.ln1(self.attn(x))               # the norm on the sublayer's output
        return x + self.ln2(self.mlp(x))


@bug("4.2", "norm_placement", "scale")
class BlockNormOnAttentionOutputOnly(GivenBlock):
    def forward(self, x):
        x = x + self.ln1(self.attn(x))
        return x + self.mlp(self.ln2(x))             # right for the feed-forward sublayer only


@bug("4.3", "gradient", "token_embedding")
class GPTEmbeddingsUnderNoGrad(GPT):
    def forward(self, idx):
        with torch.no_grad():                        # "a lookup needs no gradient"
            x = self.token_embedding(idx) + self.position_encoding(idx.shape[1])
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@bug("4.3", "gradient", "ln_f.weight")
class GPTFinalNormWeightDetached(GPT):
    def forward(self, idx):
        if idx.shape[1] > self.config.max_tokens:
            raise ValueError("too long")
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        x = F.layer_norm(x, x.shape[-1:], self.ln_f.weight.detach(), self.ln_f.bias, self.ln_f.eps)
        return self.head(x)


@bug("5.2", "gradient", "cut off")
def loss_of_detached_logits(logits, targets):
    return F.cross_entropy(logits.detach().flatten(0, 1), targets.flatten())


@bug("5.2", "gradient", "logits")
def loss_half_detached(logits, targets):
    # a log-sum-exp whose max is detached is fine; one whose whole normaliser is detached is not
    flat, flat_t = logits.flatten(0, 1), targets.flatten()
    keep = flat_t != -100
    log_z = torch.logsumexp(flat.detach(), dim=-1)
    picked = flat.gather(1, flat_t.clamp(min=0)[:, None])[:, 0]
    return (log_z - picked)[keep].mean()


@correct("5.2")
def loss_logsumexp_by_hand(logits, targets):
    flat, flat_t = logits.flatten(0, 1), targets.flatten()
    keep = flat_t != -100
    m = flat.max(-1, keepdim=True).values.detach()          # the max is a constant for the gradient anyway
    log_z = (flat - m).exp().sum(-1).log() + m[:, 0]
    picked = flat.gather(1, flat_t.clamp(min=0)[:, None])[:, 0]
    return (log_z - picked)[keep].mean()


@bug("7.2", "gradient", "value")
def hf_attention_values_detached(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    out = F.scaled_dot_product_attention(query, key, value.detach(), attn_mask=attention_mask, dropout_p=dropout,
                                         is_causal=attention_mask is None and query.shape[2] > 1, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


# ============================================================================ issue 20: the spec's edges

@correct("5.3")
def step_as_the_prose_says(model, optimizer, inputs, targets, max_grad_norm=1.0):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm:                                  # None means no clipping, as step 5 says
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@bug("5.3", "clipping", "None")
def step_clips_even_none(model, optimizer, inputs, targets, max_grad_norm=1.0):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), float(max_grad_norm))   # float(None) raises
    optimizer.step()
    return loss.item()


@bug("5.3", "zero_grad", "zero_grad")
def step_zero_grad_only_once(model, optimizer, inputs, targets, max_grad_norm=1.0):
    model.train()
    if not getattr(optimizer, "_cleared", False):   # "once at the start is enough"
        optimizer.zero_grad()
        optimizer._cleared = True
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@bug("5.4", "batch_mixing", "per row")
def sample_top_k_over_the_batch(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.flatten().topk(top_k).values[-1]            # one threshold for the whole batch
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@bug("5.4", "batch_mixing", "per row")
def sample_top_k_smallest_threshold(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values.min()          # the min over all rows
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@bug("5.1", "overlapping_windows", "overlap")
def windows_stride_one_short(ids, max_tokens):
    starts = range(0, len(ids) - max_tokens, max_tokens - 1) if max_tokens > 1 else range(len(ids) - 1)
    inputs = torch.stack([ids[s:s + max_tokens] for s in starts])
    targets = torch.stack([ids[s + 1:s + max_tokens + 1] for s in starts])
    return inputs, targets


@bug("6.2", "shape", "(N, 1)")
@torch.no_grad()
def cached_flat_new_token(model, idx, max_new_tokens):
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        next_id = logits[:, -1].argmax(-1)                 # (N,): the keepdim is missing
        idx = torch.cat([idx, next_id[:, None]], dim=1)
        logits = model(next_id, cache)
    return idx


@bug("6.2", "kv_cache", "last token again")
@torch.no_grad()
def cached_refeeds_last_prompt_token(model, idx, max_new_tokens):
    cache = model.new_cache()
    model(idx, cache)
    for _ in range(max_new_tokens):
        logits = model(idx[:, -1:], cache)                 # the first time: the prompt's last token, again
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


@bug("7.1", "split_transpose", "twice")
def split_double_transpose(weight):
    embed_dim = weight.shape[0]
    wq, wk, wv = weight.T.split(embed_dim, dim=0)          # already (out, in) ...
    return wq.T, wk.T, wv.T                                # ... and transposed back


@bug("4.3", "final_norm", "ln_f")
class GPTNoFinalNormWithCheck(GPT):
    def forward(self, idx):
        if idx.shape[1] > self.config.max_tokens:
            raise ValueError("too long")
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# ============================================================================ issue 20/21: more of our own

@bug("6.1", "flops_factor", "2N")
def flops_two_n(config, num_weights):
    return 2 * num_weights                                  # "two FLOPs per weight": the forward pass alone


@bug("5.1", "overlapping_windows", "overlap")
def windows_half_overlap(ids, max_tokens):
    step = max(1, max_tokens // 2)                          # "more examples from the same text"
    starts = range(0, len(ids) - max_tokens, step)
    return (torch.stack([ids[s:s + max_tokens] for s in starts]),
            torch.stack([ids[s + 1:s + max_tokens + 1] for s in starts]))


@bug("4.2", "norm_placement", "output", norm_first=False)
class BlockPostNormOnSublayerOutput(GivenBlock):
    def forward(self, x):
        x = x + self.ln1(self.attn(x))
        return x + self.ln2(self.mlp(x))


@bug("4.2", "gradient", "residual", norm_first=False)
class BlockPostNormDetachedResidual(GivenBlock):
    def forward(self, x):
        x = self.ln1(x.detach() + self.attn(x))
        return self.ln2(x + self.mlp(x))


@bug("4.3", "gradient", "token_embedding")
class GPTDetachedEmbeddings(GPT):
    def forward(self, idx):
        if idx.shape[1] > self.config.max_tokens:
            raise ValueError("too long")
        x = self.token_embedding(idx).detach() + self.position_encoding(idx.shape[1])
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@correct("7.1")
def split_transpose_then_chunk_rows(weight):
    return tuple(weight.T.chunk(3, dim=0))                  # one transpose, then rows: already (out, in)


# ---------------------------------------------------------------- 4.2: the mistakes a pre-norm and a post-norm block
# share, each written out both ways (the checker builds them from one pre/post block; these hold its outputs)

@bug("4.2", "sublayer_missing", "self.attn", "never applied")
class BlockAttentionDropped(GivenBlock):
    def forward(self, x):
        return x + self.mlp(self.ln2(x))


@bug("4.2", "sublayer_missing", "self.attn", "never applied", norm_first=False)
class PostBlockAttentionDropped(GivenBlock):
    def forward(self, x):
        return self.ln2(x + self.mlp(x))


@bug("4.2", "sublayer_missing", "self.mlp", norm_first=False)
class PostBlockFeedForwardDropped(GivenBlock):
    def forward(self, x):
        return self.ln1(x + self.attn(x))


@bug("4.2", "norm_placement", "ln1 for both")
class BlockLn1Twice(GivenBlock):
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln1(x))


@bug("4.2", "norm_placement", "ln2 for both", norm_first=False)
class PostBlockLn2Twice(GivenBlock):
    def forward(self, x):
        x = self.ln2(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


@bug("4.2", "norm_placement", "ln1 and ln2 are swapped", norm_first=False)
class PostBlockNormsSwapped(GivenBlock):
    def forward(self, x):
        x = self.ln2(x + self.attn(x))
        return self.ln1(x + self.mlp(x))


@bug("4.2", "norm_placement", "never applied", "LayerNorms", norm_first=False)
class PostBlockNoNorms(GivenBlock):
    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


@bug("4.2", "residual", "feed-forward", "no residual")
class BlockNoMlpResidual(GivenBlock):
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return self.mlp(self.ln2(x))


@bug("4.2", "residual", "attention sublayer", "no residual", norm_first=False)
class PostBlockNoAttnResidual(GivenBlock):
    def forward(self, x):
        x = self.ln1(self.attn(x))
        return self.ln2(x + self.mlp(x))


@bug("4.2", "residual", "neither", norm_first=False)
class PostBlockNoResiduals(GivenBlock):
    def forward(self, x):
        return self.ln2(self.mlp(self.ln1(self.attn(x))))


@bug("4.2", "norm_placement", "both before", "post-norm", norm_first=False)
class PostBlockNormalisedTwice(GivenBlock):
    def forward(self, x):
        x = self.ln1(x + self.attn(self.ln1(x)))
        return self.ln2(x + self.mlp(self.ln2(x)))


# ============================================================================ issue 43: one more of our own per name
# Each class of mistake named for issue 43 meets an attempt written another way than the one it was named for.

@bug("4.1", "sincos_layout", "cosines first", "interleave")
def table_cosines_then_sines(max_tokens, embed_dim):
    angles = torch.arange(max_tokens)[:, None] / 10000 ** (torch.arange(0, embed_dim, 2) / embed_dim)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


@bug("4.1", "positions", "start at 1")
def table_positions_shifted_by_one(max_tokens, embed_dim):
    pe = torch.zeros(max_tokens + 1, embed_dim)
    angles = torch.arange(max_tokens + 1)[:, None] / 10000 ** (torch.arange(0, embed_dim, 2) / embed_dim)
    pe[:, 0::2], pe[:, 1::2] = angles.sin(), angles.cos()
    return pe[1:]                                   # drops row 0, the one for position 0


@bug("4.2", "norm_placement", "feed-forward sublayer has no LayerNorm")
class BlockForgotLn2(GivenBlock):
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(x)


@bug("4.2", "sublayer_missing", "self.mlp", norm_first=False)
class PostBlockMlpComputedNotAdded(GivenBlock):
    def forward(self, x):
        x = self.ln1(x + self.attn(x))
        self.mlp(x)                                 # computed, then forgotten
        return self.ln2(x)


@bug("4.3", "block_chain", "reverse")
class GPTBlocksReversed(GPT):
    def forward(self, idx, cache=None):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        for block in reversed(self.blocks):
            x = block(x)
        return self.head(self.ln_f(x))


@bug("4.3", "positions", "positions")
class GPTEveryTokenAtPositionZero(GPT):
    def forward(self, idx, cache=None):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(1))   # broadcast: position 0 for all
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@bug("4.3", "logits", "logits, not probabilities")
class GPTReturnsSoftmaxOverVocab(GPT):
    def forward(self, idx, cache=None):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return torch.exp(logits) / torch.exp(logits).sum(dim=-1, keepdim=True)


@bug("4.3", "scale", "sqrt")
class GPTScaledSum(GPT):
    def forward(self, idx, cache=None):
        x = self.token_embedding(idx) + self.position_encoding(idx.shape[1])
        x = self.dropout(x * self.config.embed_dim ** 0.5)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@bug("4.3", "context_limit", "max_tokens")
class GPTKeepsFirstTokens(GPT):
    def forward(self, idx, cache=None):
        idx = idx[:, :self.config.max_tokens]     # quietly drops the newest tokens
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@bug("5.1", "target_shift", "roll", "wraps")
def windows_targets_rolled(ids, max_tokens):
    inputs = ids[:len(ids) - 1].unfold(0, max_tokens, max_tokens)
    return inputs, inputs.roll(-1, dims=1)          # the last target wraps round to the first input


@bug("5.1", "target_shift", "next")
def windows_targets_copied(ids, max_tokens):
    chunks = ids.unfold(0, max_tokens + 1, max_tokens)
    inputs = chunks[:, :-1]
    return inputs, inputs.clone()


@bug("5.2", "logits", "log-probabilities")
def loss_nll_of_softmax(logits, targets):
    probs = logits.softmax(dim=-1)                  # the log forgotten
    return F.nll_loss(probs.flatten(0, 1), targets.flatten())


@bug("5.2", "loss_reduction", "batch size")
def loss_summed_over_batch_size(logits, targets):
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return total / logits.shape[0]


@bug("5.3", "step_order", "more than once")
def step_steps_twice(model, optimizer, inputs, targets):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.step()                                # the same gradients applied again
    return loss.item()


@bug("5.3", "step_order", "loss.backward()")
def step_backward_on_a_copy(model, optimizer, inputs, targets):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.detach().requires_grad_().backward()       # the graph to the weights is cut: no gradients
    optimizer.step()
    return loss.item()


@bug("5.4", "greedy", "randomness")
def sample_greedy_unless_hot(logits, temperature=1.0, top_k=None, generator=None):
    if temperature <= 1.0:
        return logits.argmax(dim=-1)                # "low temperature means greedy"
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@bug("5.4", "top_k", "-inf")
def sample_topk_where_zero(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, [-1]]
        logits = torch.where(logits < kth, torch.zeros_like(logits), logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@bug("5.4", "top_k", "keep 4 tokens instead of top_k=3")
def sample_topk_sorted_index_k(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.sort(dim=-1, descending=True).values[:, top_k:top_k + 1]   # the (k+1)-th, not the k-th
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@bug("6.1", "attention_flops", "number of heads", "number of layers")
def flops_attention_of_one_head_in_one_layer(config, num_weights):
    return 6 * num_weights + 12 * config.head_dim * config.max_tokens


@bug("6.1", "attention_flops", "vocab_size")
def flops_vocab_for_context(config, num_weights):
    return 6 * num_weights + 12 * config.num_layers * config.num_heads * config.head_dim * config.vocab_size


@bug("6.1", "flops_units", "whole window", "MFLOPs")
def flops_per_window_in_mflops(config, num_weights):
    per_token = 6 * num_weights + 12 * config.num_layers * config.embed_dim * config.max_tokens
    return per_token * config.max_tokens / 1e6


@bug("6.1", "weights_count", "embeddings", "the token embedding included")
def flops_adds_token_embeddings(config, num_weights):
    n = num_weights + config.vocab_size * config.embed_dim     # "the embeddings are weights too"
    return 6 * n + 12 * config.num_layers * config.embed_dim * config.max_tokens


@bug("6.1", "weights_count", "num_weights argument")
def flops_counts_parameters_itself(config, num_weights):
    n = GPT(config).num_parameters()                # every parameter, embeddings too; the argument unused
    return 6 * n + 12 * config.num_layers * config.embed_dim * config.max_tokens


@bug("6.2", "positions", "one position late")
def cached_positions_read_after_append(model, idx, max_new_tokens):
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        next_id = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, next_id], dim=1)
        x = model.token_embedding(next_id) + model.position_encoding(1, idx.shape[1])   # after the append
        for block, layer_cache in zip(model.blocks, cache):
            x = block(x, layer_cache)
        logits = model.head(model.ln_f(x))
    return idx


@bug("6.2", "greedy", "at random")
def cached_samples_with_categorical(model, idx, max_new_tokens):
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        next_id = torch.distributions.Categorical(logits=logits[:, -1] / 2.0).sample()[:, None]
        idx = torch.cat([idx, next_id], dim=1)
        logits = model(next_id, cache)
    return idx
