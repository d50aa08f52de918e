"""Round 36a (notebook 01): 1.3 scaled_dot_product_attention with q, k and v flattened to 2-D, so that every query
sees the keys of every sequence of the batch, was ``mismatch``: right for a batch of one, it now meets the engine's
batch probe (each sequence and head alone right, the batch together wrong: ``batch_mixing``). Its right twin
flattens the leading axes into one batch axis and keeps them apart (torch.bmm)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank

BUGGY, CORRECT, bug, correct = new_bank()


@correct("1.3")
def sdpa_bmm_over_flattened_batch(q, k, v, mask=None):
    """Flatten the leading axes into one batch axis, torch.bmm, and reshape back."""
    *batch, lq, d = q.shape
    lk, dv = k.shape[-2], v.shape[-1]
    q3, k3, v3 = q.reshape(-1, lq, d), k.reshape(-1, lk, d), v.reshape(-1, lk, dv)   # (B, L, d)
    scores = torch.bmm(q3, k3.transpose(1, 2)) * d ** -0.5                              # (B, Lq, Lk)
    if mask is not None:
        scores = scores.masked_fill(~mask.expand(*batch, lq, lk).reshape(-1, lq, lk), float("-inf"))
    out = torch.bmm(F.softmax(scores, dim=2), v3)                                       # (B, Lq, dv)
    return out.reshape(*batch, lq, dv)


@bug("1.3", "batch_mixing", "alone")
def sdpa_flattens_every_leading_axis(q, k, v, mask=None):
    """'Any leading axes' handled by flattening q, k and v to 2-D: every query then sees every sequence's keys."""
    d, dv = q.shape[-1], v.shape[-1]
    scores = q.reshape(-1, d) @ k.reshape(-1, d).T / math.sqrt(d)          # (B*Lq, B*Lk)
    if mask is not None:
        scores = scores.masked_fill(~mask.expand(*q.shape[:-1], k.shape[-2]).reshape(-1, k.shape[-2]).repeat(
            1, scores.shape[-1] // k.shape[-2]), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.reshape(-1, dv)
    return out.reshape(*q.shape[:-1], dv)
