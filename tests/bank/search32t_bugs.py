"""Round 32, the tester's (r32a) attempts at 1.3, 5.2, 5.4 and 6.2 that got a verdict without the mistake's name.

1.3: a factor on the scores from a size read on the wrong axis (q.shape[2] is d for 3-D inputs, Lq for 4-D ones;
q.size(1), k.shape[-2], v.shape[-1]) was "a factor of 0.4472" beside the expected one. Now the size is named: the
read of a shape whose 1/sqrt (or 1/size) is the factor found on every call, and what that axis holds.

6.2: generation written for a batch of one: one token per step for the whole batch, taken from sequence 0's logits,
was a bare mismatch from new token 0 on; one that crashes on a batch (a (1, N) token, .item()) was the raw error.
Now ``shape``: "right for sequence 0 only", or "each sequence alone generates the right tokens".

5.4: the k-th largest logit taken without keepdim, (N,), raised a size mismatch on the batch (and when N == V is
silently compared along the vocabulary). Now ``top_k``, naming values[:, -1:] / keepdim=True, where the call runs
on one row and on the batch without top_k.

5.2: label_smoothing=0.1 copied from a recipe was a mismatch of numbers. The smoothed loss is a straight line in
its label_smoothing, so the value is solved from one case and checked on every other: the message names it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank

BUGGY, CORRECT, bug, correct = new_bank()


def _attend(q, k, v, mask, factor):
    scores = q @ k.transpose(-2, -1) * factor
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# ============================================================================ 1.3: a size from the wrong axis


@bug("1.3", "scale", "shape[-1]", "Lq", "1/sqrt(5)")
def sdpa_scale_from_axis_2(q, k, v, mask=None):
    """(r32a) d read as q.shape[2]: right for 3-D (N, L, d) inputs, Lq for 4-D (N, H, L, d) ones."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@bug("1.3", "scale", "q.shape[1]", "Lq", "shape[-1]")
def sdpa_scale_from_size_1(q, k, v, mask=None):
    """q.size(1): d for 2-D inputs, Lq for 3-D ones, the heads for 4-D ones."""
    return _attend(q, k, v, mask, q.size(1) ** -0.5)


@bug("1.3", "scale", "k.shape[-2]", "Lk, the number of keys")
def sdpa_scale_by_number_of_keys(q, k, v, mask=None):
    """1/sqrt(number of keys): the length where the size of the vectors is meant."""
    return _attend(q, k, v, mask, 1 / math.sqrt(k.shape[-2]))


@bug("1.3", "scale", "v.shape[-1]", "dv")
def sdpa_scale_by_value_size_written_out(q, k, v, mask=None):
    """The size of the values: dv is not d."""
    dv = v.shape[-1]
    return _attend(q, k, v, mask, dv ** -0.5)


@bug("1.3", "scale", "square root", "d itself")
def sdpa_divided_by_axis_2(q, k, v, mask=None):
    """Divides by q.shape[2] itself: d (no square root) for 3-D inputs, Lq for 4-D ones."""
    return _attend(q, k, v, mask, 1 / q.shape[2])


@correct("1.3")
def sdpa_scale_from_keys_last_axis(q, k, v, mask=None):
    """d read on k, whose last axis is d too."""
    return _attend(q, k, v, mask, k.shape[-1] ** -0.5)


@correct("1.3")
def sdpa_scale_from_dim_minus_one(q, k, v, mask=None):
    """q.size(q.dim() - 1): the last axis, counted from the front."""
    return _attend(q, k, v, mask, 1.0 / math.sqrt(q.size(q.dim() - 1)))


# ============================================================================ 5.2: label smoothing


@bug("5.2", "mismatch", "label_smoothing", "label smoothing")
def loss_label_smoothing(logits, targets):
    """(r32a) label_smoothing=0.1 copied from a recipe: not the loss asked."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, label_smoothing=0.1)


@bug("5.2", "mismatch", "label_smoothing=0.2")
def loss_label_smoothing_classes_first(logits, targets):
    """label_smoothing=0.2 with the classes moved to dimension 1."""
    return F.cross_entropy(logits.transpose(1, 2), targets, label_smoothing=0.2)


@bug("5.2", "mismatch", "label_smoothing=0.05")
def loss_smoothed_by_hand(logits, targets):
    """Label smoothing written by hand: 0.95 of the target's -log p plus 0.05 of the mean over the vocabulary."""
    logp = F.log_softmax(logits, dim=-1)
    keep = targets != -100
    picked = -logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    spread = -logp.mean(-1)
    return ((0.95 * picked + 0.05 * spread) * keep).sum() / keep.sum()


@correct("5.2")
def loss_label_smoothing_zero(logits, targets):
    """label_smoothing=0.0 written out: the plain cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), label_smoothing=0.0)


# ============================================================================ 5.4: a per-row threshold without its axis


def _sample(logits, temperature, top_k, generator, kth_of):
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        logits = logits.masked_fill(logits < kth_of(logits, top_k), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("5.4", "top_k", "keepdim", "[:, -1:]")
def sample_kth_without_keepdim(logits, temperature=1.0, top_k=None, generator=None):
    """(r32a) kth = topk(...).values[:, -1] without keepdim: (N, V) < (N,) broadcasts along the vocabulary."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("5.4", "top_k", "keepdim")
def sample_kthvalue_without_keepdim(logits, temperature=1.0, top_k=None, generator=None):
    """torch.kthvalue for the k-th largest, without keepdim: one threshold per row, shape (N,)."""
    return _sample(logits, temperature, top_k, generator,
                   lambda z, k: torch.kthvalue(z, z.shape[-1] - k + 1, dim=-1).values)


@bug("5.4", "top_k", "keepdim")
def sample_min_of_topk_without_keepdim(logits, temperature=1.0, top_k=None, generator=None):
    """The smallest of the top k, .min(dim=-1) without keepdim."""
    return _sample(logits, temperature, top_k, generator, lambda z, k: z.topk(k).values.min(dim=-1).values)


@correct("5.4")
def sample_min_of_topk_keepdim(logits, temperature=1.0, top_k=None, generator=None):
    return _sample(logits, temperature, top_k, generator,
                   lambda z, k: z.topk(k).values.min(dim=-1, keepdim=True).values)


@correct("5.4")
def sample_kth_unsqueezed(logits, temperature=1.0, top_k=None, generator=None):
    """values[:, -1].unsqueeze(-1): the axis put back."""
    return _sample(logits, temperature, top_k, generator, lambda z, k: z.topk(k).values[:, -1].unsqueeze(-1))


# ============================================================================ 6.2: a batch of one assumed


@bug("6.2", "shape", "sequence 0 only", "argmax per row")
@torch.no_grad()
def gen_batch_of_one(model, idx, max_new_tokens):
    """(r32a) logits[0, -1].argmax().view(1, 1): written for a batch of one sequence."""
    cache = model.new_cache()
    logits = model(idx, cache)
    for step in range(max_new_tokens):
        next_id = logits[0, -1].argmax().view(1, 1)
        idx = torch.cat([idx, next_id.expand(idx.shape[0], 1)], dim=1)
        if step + 1 < max_new_tokens:
            logits = model(idx[:, -1:], cache)
    return idx


@bug("6.2", "shape", "sequence 1 only", "argmax per row")
@torch.no_grad()
def gen_last_sequence_for_all(model, idx, max_new_tokens):
    """logits[-1, -1].argmax(), repeated for every row: the last sequence's token for the whole batch."""
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        next_id = logits[-1, -1].argmax().repeat(idx.shape[0], 1)
        idx = torch.cat([idx, next_id], dim=1)
        logits = model(next_id, cache)
    return idx


@bug("6.2", "shape", "batch of one")
@torch.no_grad()
def gen_squeezed_token_in_a_row(model, idx, max_new_tokens):
    """argmax(-1) squeezed, then viewed as (1, -1): (1, 1) for one sequence, (1, N) for a batch, which cat refuses."""
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        next_id = logits[:, -1].argmax(-1).squeeze().view(1, -1)
        idx = torch.cat([idx, next_id], dim=1)
        logits = model(next_id, cache)
    return idx


@bug("6.2", "shape", "batch of one")
@torch.no_grad()
def gen_item_token(model, idx, max_new_tokens):
    """.item() of the argmax over the whole (N, V) last logits: a flat index, the token id only for one sequence."""
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        token = logits[:, -1].argmax().item()
        next_id = torch.full((idx.shape[0], 1), token, dtype=idx.dtype)
        idx = torch.cat([idx, next_id], dim=1)
        logits = model(next_id, cache)
    return idx


@correct("6.2")
@torch.no_grad()
def gen_argmax_row_by_row(model, idx, max_new_tokens):
    """One argmax per row in a Python loop, stacked to (N, 1)."""
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        next_id = torch.stack([row.argmax() for row in logits[:, -1]])[:, None]
        idx = torch.cat([idx, next_id], dim=1)
        logits = model(next_id, cache)
    return idx
