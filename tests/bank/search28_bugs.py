"""Student attempts from the twenty-eighth search's leftovers (2026-11-30), in styles the tester's bank did not hold:
each wrong one was misjudged before (passed, or named another mistake).

State kept between calls that the calls in turn missed: a generation cache kept per batch size (6.2: "you draw them
at random"), a dropout mask redrawn only every few calls (2.2, 3.3), state kept only in half precision or made from
the weights and kept past a weight step (9.3, 11.3), a mask cached by its length that stays on the CPU after
model.to(device) (2.2, 3.3, 7.2). A dropout mask broadcast over the batch or the heads (2.2, 3.3: "dropout on the
features", or passed). And two mistakes told only by their numbers (5.2 logits flattened position by position, 11.2
half - 1 entries dropped). Right code beside each, where a new probe could refuse it.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from bank.search27_bugs import _greedy_into
from course_lib.attention import MaskedAttention, MultiHeadMaskedAttention, merge_heads, split_heads
from course_lib.modern import RMSNorm

BUGGY, CORRECT, bug, correct = new_bank()

_KEPT: dict = {}


# ============================================================================ 6.2: a cache kept per batch size

@bug("6.2", "kept_state", "keeps something from one call to the next", avoids=("at random",))
@torch.no_grad()
def generate_with_one_cache_per_batch_size(model, idx, max_new_tokens):
    """A 'session' per batch size, stored on the model: its cache goes on while it has room."""
    sessions = model.__dict__.setdefault("sessions", {})                         # batch size -> [cache, tokens in it]
    session = sessions.get(idx.shape[0])
    if session is None or session[1] + idx.shape[1] + max_new_tokens > model.config.max_tokens:
        session = sessions[idx.shape[0]] = [model.new_cache(), 0]
    session[1] += idx.shape[1] + max_new_tokens
    return _greedy_into(model, idx, session[0], max_new_tokens)


@correct("6.2")
@torch.no_grad()
def generate_counting_its_calls(model, idx, max_new_tokens):
    """State that changes nothing: how many generations ran, kept in a global."""
    _KEPT["6.2 calls"] = _KEPT.get("6.2 calls", 0) + 1
    return _greedy_into(model, idx, model.new_cache(), max_new_tokens)


# ============================================================================ 2.2 and 3.3: dropout masks

def _single_head(self, x, drop):
    length = x.shape[1]
    s = self.query(x) @ self.key(x).transpose(-2, -1) / math.sqrt(self.embed_dim)   # (N, L, L)
    w = s.masked_fill(~self.mask[:length, :length], float("-inf")).softmax(dim=-1)
    return self.proj_dropout(self.proj(drop(w) @ self.value(x)))


def _multi_head(self, x, drop):
    length = x.shape[1]
    q, k, v = (split_heads(f(x), self.num_heads) for f in (self.query, self.key, self.value))   # (N, H, L, d)
    s = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
    w = s.masked_fill(~self.mask[:length, :length], float("-inf")).softmax(dim=-1)   # (N, H, L, L)
    return self.proj_dropout(self.proj(merge_heads(drop(w) @ v)))


def _bernoulli_drop(module, one_for_the_batch):
    """Dropout by hand: a Bernoulli mask of the weights' shape, or of one sequence's, broadcast over the batch."""
    p = module.dropout_rate

    def drop(w):
        if not module.training or p == 0:
            return w
        shape = (1, *w.shape[1:]) if one_for_the_batch else w.shape
        return w * torch.bernoulli(torch.full(shape, 1 - p, device=w.device)) / (1 - p)
    return drop


@bug("2.2", "dropout", "every sequence of the batch gets the same dropout mask", avoids=("single features",))
class MaskedAttentionWithOneMaskForTheBatch(MaskedAttention):
    """A Bernoulli mask of shape (1, L, L), drawn anew at each call, broadcast over the batch."""

    def forward(self, x):
        return _single_head(self, x, _bernoulli_drop(self, one_for_the_batch=True))


@bug("3.3", "dropout", "every sequence of the batch gets the same dropout mask", avoids=("single features",))
class MultiHeadAttentionWithOneMaskForTheBatch(MultiHeadMaskedAttention):
    """F.dropout applied to ones of shape (1, H, L, L), then multiplied in: one mask for every sequence."""

    def forward(self, x):
        def drop(w):
            return w * F.dropout(torch.ones_like(w[:1]), self.dropout_rate, self.training)
        return _multi_head(self, x, drop)


@bug("3.3", "dropout", "every head gets the same dropout mask")
class MultiHeadAttentionWithOneMaskForTheHeads(MultiHeadMaskedAttention):
    """F.dropout applied to ones of shape (N, 1, L, L): every head drops the same weights."""

    def forward(self, x):
        def drop(w):
            return w * F.dropout(torch.ones_like(w[:, :1]), self.dropout_rate, self.training)
        return _multi_head(self, x, drop)


@correct("3.3")
class MultiHeadAttentionWithItsOwnMask(MultiHeadMaskedAttention):
    """The same style with a mask of the weights' full shape: right."""

    def forward(self, x):
        def drop(w):
            return w * F.dropout(torch.ones_like(w), self.dropout_rate, self.training)
        return _multi_head(self, x, drop)


@correct("2.2")
class MaskedAttentionWithABernoulliMask(MaskedAttention):
    """A Bernoulli mask of the weights' full shape, drawn at each call: right."""

    def forward(self, x):
        return _single_head(self, x, _bernoulli_drop(self, one_for_the_batch=False))


@bug("2.2", "kept_state", "same attention weights", "draws a new mask")
class MaskedAttentionRedrawsEveryOtherCall(MaskedAttention):
    """The mask is kept and redrawn at every second call (or when the shape changes)."""

    def forward(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        p = self.dropout_rate

        def drop(w):
            if not self.training or p == 0:
                return w
            kept = getattr(self, "kept", None)
            if kept is None or kept.shape != w.shape or self.calls % 2 == 0:
                kept = self.kept = (torch.rand_like(w) >= p).to(w.dtype) / (1 - p)
            return w * kept
        return _single_head(self, x, drop)


@bug("3.3", "kept_state", "same attention weights", "draws a new mask")
class MultiHeadAttentionCyclesThreeMasks(MultiHeadMaskedAttention):
    """Three masks per shape, drawn once and used in turn: each comes back every third call."""

    def forward(self, x):
        p = self.dropout_rate

        def drop(w):
            if not self.training or p == 0:
                return w
            masks = _KEPT.setdefault(("3.3 masks", id(self), w.shape), [])
            if len(masks) < 3:
                masks.append((torch.rand_like(w) >= p).to(w.dtype) / (1 - p))
                return w * masks[-1]
            masks.append(masks.pop(0))
            return w * masks[-1]
        return _multi_head(self, x, drop)


# ============================================================================ masks cached by length, without device

@bug("3.3", "device", "kept from those calls", "device")
class MultiHeadAttentionCachesMasksByLength(MultiHeadMaskedAttention):
    """Causal masks made on x's device but kept in a global by length alone: after model.to(device) the CPU one
    comes back."""

    def forward(self, x):
        length = x.shape[1]
        mask = _KEPT.setdefault(("3.3 mask", length), torch.ones(length, length, dtype=torch.bool,
                                                                   device=x.device).tril())
        q, k, v = (split_heads(f(x), self.num_heads) for f in (self.query, self.key, self.value))
        w = (q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)).masked_fill(~mask, float("-inf")).softmax(-1)
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(w) @ v)))


@correct("2.2")
class MaskedAttentionCachesMasksByLengthAndDevice(MaskedAttention):
    """The same cache keyed by the device too: right."""

    def forward(self, x):
        length = x.shape[1]
        masks = self.__dict__.setdefault("masks", {})
        if (length, x.device) not in masks:
            masks[length, x.device] = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        s = self.query(x) @ self.key(x).transpose(-2, -1) / math.sqrt(self.embed_dim)
        w = self.attn_dropout(s.masked_fill(~masks[length, x.device], float("-inf")).softmax(dim=-1))
        return self.proj_dropout(self.proj(w @ self.value(x)))


@bug("7.2", "device", "earlier one and kept")
def attention_with_masks_kept_by_size(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                      **kwargs):
    """Causal masks made on the query's device, kept in a global by (Lq, Lk) alone."""
    lq, lk = query.shape[-2], key.shape[-2]
    if attention_mask is None:
        attention_mask = _KEPT.setdefault(("7.2 mask", lq, lk), torch.ones(lq, lk, dtype=torch.bool,
                                                                            device=query.device).tril(lk - lq))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2), None


# ============================================================================ 9.3: half precision, weights kept

@bug("9.3", "kept_state", "float16", "keeps something")
class RMSNormRemembersItsHalfStatistic(RMSNorm):
    """In float16 the mean square of the first call of each shape is kept (a 'fast path')."""

    def forward(self, x):
        h = x.float()
        ms = h.pow(2).mean(-1, keepdim=True)
        if x.dtype == torch.float16:
            ms = self.__dict__.setdefault(f"ms{tuple(x.shape)}", ms)
        return (h * torch.rsqrt(ms + self.eps) * self.weight.float()).to(x.dtype)


@bug("9.3", "kept_state", "weights changed", "new values")
class RMSNormKeepsAHalfWeight(RMSNorm):
    """For float16 inputs, the weight cast to float16 once and kept: an optimizer's step never reaches it."""

    def forward(self, x):
        h = x.float()
        normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        if x.dtype == torch.float16:
            if getattr(self, "weight16", None) is None:
                self.weight16 = self.weight.detach().half()
            return normed * self.weight16
        return normed * self.weight.to(x.dtype)


@correct("9.3")
class RMSNormKeepsItsEpsilonPerDtype(RMSNorm):
    """State that changes nothing: eps as a tensor, kept per dtype and device."""

    def forward(self, x):
        h = x.float()
        eps = self.__dict__.setdefault("eps_tensors", {}).setdefault((h.dtype, h.device), torch.tensor(
            self.eps, dtype=h.dtype, device=h.device))
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * self.weight.float()).to(x.dtype)


# ============================================================================ 11.3: weights saved once

@bug("11.3", "kept_state", "saved in an earlier call")
@contextlib.contextmanager
def ablate_head_saving_the_columns_once(model, layer, head, _saved={}):   # noqa: B006 - the kept dict is the mistake
    """The head's columns saved the first time this model's head is switched off, put back from there ever after."""
    attn = model.blocks[layer].attn
    columns = slice(head * attn.head_dim, (head + 1) * attn.head_dim)
    kept = _saved.get((id(model), layer, head))                               # (the model, its columns)
    if kept is None or kept[0] is not model:
        kept = _saved[id(model), layer, head] = (model, attn.proj.weight[:, columns].detach().clone())
    with torch.no_grad():
        attn.proj.weight[:, columns] = 0.0
    try:
        yield model
    finally:
        with torch.no_grad():
            attn.proj.weight[:, columns] = kept[1]


@correct("11.3")
@contextlib.contextmanager
def ablate_head_with_its_slices_cached(model, layer, head):
    """State that changes nothing: the column slices kept in a global; the weights saved at every call."""
    attn = model.blocks[layer].attn
    columns = _KEPT.setdefault(("11.3", attn.head_dim, head), slice(head * attn.head_dim, (head + 1) * attn.head_dim))
    saved = attn.proj.weight[:, columns].detach().clone()
    with torch.no_grad():
        attn.proj.weight[:, columns] = 0.0
    try:
        yield model
    finally:
        with torch.no_grad():
            attn.proj.weight[:, columns] = saved


# ============================================================================ named mistakes

@bug("5.2", "target_shift", "logits are flattened in another order")
def loss_with_the_logits_permuted(logits, targets):
    return F.cross_entropy(logits.permute(1, 0, 2).flatten(0, 1), targets.flatten(), ignore_index=-100)


@bug("11.2", "score_positions", "half - 1", "drop one entry")
def induction_score_from_query_2half_minus_2(weights, half):
    rows = range(2 * half - 2, weights.shape[-1])                              # the diagonal's first half-1 dropped
    return torch.stack([weights[:, :, i, i - half + 1] for i in rows], dim=-1).mean(dim=(0, 2))
