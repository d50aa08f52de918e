"""Student attempts that the engine's shared probes must catch, whatever the exercise (issue 43).

Each is right on the exercise's ordinary, well-scaled inputs, in float32, and wrong only where a probe looks:
large scores, rows far below zero or of different scales (``magnitude``), a float64 notebook (``dtype``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 1.2, 1.3: attention's softmax
# Right on well-scaled inputs; wrong on large scores, rows far below zero, or rows of different scales.

@bug("1.2", "overflow", "maximum")
def toy_softmax_by_hand(query, keys, values):
    scores = keys @ query
    weights = torch.exp(scores) / torch.exp(scores).sum()
    return weights @ values


@bug("1.2", "overflow", "maximum")
def toy_maximum_from_zero(query, keys, values):
    scores = keys @ query
    m = torch.clamp(scores.max(), min=0.0)   # a running maximum that starts at 0
    e = torch.exp(scores - m)
    return (e / e.sum()) @ values


@bug("1.3", "nan", "each row's maximum")   # 1.3's own large case finds it first, with its own words
def sdpa_one_maximum_for_all_rows(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    e = torch.exp(scores - scores.max())   # the maximum of the whole tensor, not of each row
    return e / e.sum(dim=-1, keepdim=True) @ v


@bug("1.3", "overflow", "maximum")
def sdpa_maximum_from_zero(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True).clamp(min=0.0)
    e = torch.exp(scores - m)
    return e / e.sum(dim=-1, keepdim=True) @ v


@bug("1.3", "dtype", "float64")
def sdpa_float32_scale(q, k, v, mask=None):
    scale = torch.tensor(q.shape[-1], dtype=torch.float32).rsqrt()   # a float32 written into the code
    scores = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).float()


@bug("1.2", "dtype", "float64")
def toy_returns_float32(query, keys, values):
    return (torch.softmax(keys @ query, dim=0) @ values).to(torch.float32)


@correct("1.2")
def toy_softmax_max_subtracted(query, keys, values):
    scores = keys @ query
    e = torch.exp(scores - scores.max())
    return (e / e.sum()) @ values


@correct("1.3")
def sdpa_rowwise_maximum_by_hand(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True) @ v


# ============================================================================ 5.2: the loss's log-softmax

@bug("5.2", "overflow", "cross_entropy")
def loss_log_of_softmax(logits, targets):
    probs = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
    picked = probs.flatten(0, 1)[torch.arange(targets.numel()), targets.flatten().clamp(min=0)]
    keep = targets.flatten() != -100
    return -torch.log(picked)[keep].mean()


@bug("5.2", "overflow", "log_softmax")
def loss_log_softmax_by_hand_without_maximum(logits, targets):
    log_probs = logits - torch.log(torch.exp(logits).sum(-1, keepdim=True))
    return F.nll_loss(log_probs.flatten(0, 1), targets.flatten(), ignore_index=-100)


@correct("5.2")
def loss_log_softmax_as_logsumexp(logits, targets):
    log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return F.nll_loss(log_probs.flatten(0, 1), targets.flatten(), ignore_index=-100)


# ============================================================================ 2.2: a module's dtype

from bank.attention_bugs import GivenMaskedAttention  # noqa: E402  (the notebook's given constructor)


@bug("2.2", "dtype", "float64")
class MaskedFloat32Scores(GivenMaskedAttention):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x).float(), self.key(x).float(), self.value(x).float()
        scores = (q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)).masked_fill(
            ~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(torch.softmax(scores, dim=-1))
        return self.proj_dropout(self.proj((weights @ v).to(self.proj.weight.dtype))).float()
