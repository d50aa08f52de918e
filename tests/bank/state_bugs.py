"""Student attempts from a seventh scripted search (2026-11-29): right code in styles the checks had not met, and
code that keeps state between calls (a random seed set in forward, a result or a hook kept for later).

Before, each right one was refused and each wrong one passed or got another cause; now each is judged as the
exercise's text says.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from bank.attention_bugs import GivenMaskedAttention, GivenMultiHeadAttention
from bank.search_bugs import _GivenGQA
from course_lib.attention import KVCache, causal_mask, merge_heads, split_heads
from course_lib.modern import RMSNorm, apply_rotary, repeat_kv

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ the cell's own helpers
class _GQAWithGivenCache(_GivenGQA):
    """Notebook 09's cell as given: its new_cache is the course's, line for line."""

    def new_cache(self):
        return KVCache(self.max_tokens)

    def attend(self, x, cache):
        start = cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        k, v = cache.append(k, split_heads(self.value(x), self.num_kv_heads))
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        mask = causal_mask(start + x.shape[1])[start:].to(x.device)
        return self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))


@correct("9.6")
class GQAFreshCacheFromGivenHelper(_GQAWithGivenCache):
    """Without a cache, one from the cell's own self.new_cache(): one code path for both (it was taken for the
    course's GroupedQueryAttention doing the work)."""

    def forward(self, x, cache=None):
        return self.attend(x, self.new_cache() if cache is None else cache)


@bug("9.6", "kept_state", "self._own", "cache the caller passes")
class GQAKeepsACacheOfItsOwn(_GQAWithGivenCache):
    """Without a cache, one kept on the module from call to call: a later call attends to the earlier calls' tokens.
    It was told to cut its causal mask."""

    def forward(self, x, cache=None):
        if cache is None:
            if getattr(self, "_own", None) is None:
                self._own = self.new_cache()
            cache = self._own
        return self.attend(x, cache)


# ============================================================================ dropout that repeats
@bug("2.2", "dropout", "same output twice", "manual_seed")
class MaskedSeedsInForward(GivenMaskedAttention):
    """A seed set at the top of forward: every training call drops the same weights (and resets the notebook's
    random numbers). It passed: every dropout probe seeds alike before each call."""

    def forward(self, x):
        torch.manual_seed(0)
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)).masked_fill(
            ~self.mask[:length, :length], float("-inf"))
        return self.proj_dropout(self.proj(self.attn_dropout(scores.softmax(-1)) @ v))


@bug("3.3", "dropout", "same output twice")
class MultiSeedsInForward(GivenMultiHeadAttention):
    def forward(self, x):
        torch.random.manual_seed(1234)
        length = x.shape[1]
        q, k, v = (split_heads(f(x), self.num_heads) for f in (self.query, self.key, self.value))
        scores = (q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)).masked_fill(
            ~self.mask[:length, :length], float("-inf"))
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(scores.softmax(-1)) @ v)))


@bug("2.2", "kept_state", "buffer `mask`")
class MaskedCutsItsBuffer(GivenMaskedAttention):
    """The mask buffer replaced by its L x L corner in forward: a later, longer input finds it cut. It was blamed on
    a mask not cut to the length, which the code does cut."""

    def forward(self, x):
        length = x.shape[1]
        self.mask = self.mask[:length, :length]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)).masked_fill(~self.mask, float("-inf"))
        return self.proj_dropout(self.proj(self.attn_dropout(scores.softmax(-1)) @ v))


# ============================================================================ results kept between calls
_SCORES_BY_SHAPE: dict = {}


@bug("1.3", "kept_state", "earlier call")
def sdpa_kept_by_shape(q, k, v, mask=None):
    """The answer kept per shape: a later call of the same shapes gets the first one's (it was blamed on
    torch.no_grad())."""
    key = (q.shape, k.shape, v.shape, mask is None, q.dtype, torch.is_grad_enabled())
    if key not in _SCORES_BY_SHAPE:
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        _SCORES_BY_SHAPE[key] = torch.softmax(scores, -1) @ v
    return _SCORES_BY_SHAPE[key]


@bug("3.3", "kept_state", "optimizer step")
class MultiProjectionsKeptForSameX(GivenMultiHeadAttention):
    """q, k and v recomputed only when x is another tensor: a second step on the same batch reads the weights of
    the first. It passed."""

    def forward(self, x):
        if getattr(self, "_last_x", None) is not x:
            self._last_x = x
            self._qkv = tuple(split_heads(f(x), self.num_heads) for f in (self.query, self.key, self.value))
        q, k, v = self._qkv
        length = x.shape[1]
        scores = (q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)).masked_fill(
            ~self.mask[:length, :length], float("-inf"))
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(scores.softmax(-1)) @ v)))


@bug("9.3", "kept_state")
class RMSNormKeepsItsStatistic(RMSNorm):
    """The root mean square of the first input of each shape kept: a new input of that shape is divided by the
    old one. It passed."""

    def forward(self, x):
        kept = self.__dict__.setdefault("_rms", {})
        if x.shape not in kept:
            kept[x.shape] = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x / kept[x.shape] * self.weight


# ============================================================================ sampling: the random state
def _sample(logits, temperature, top_k, generator):
    """Steps 1 to 4 of 5.4, right: the attempts below differ only in the generator they pass."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        logits = logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)


@bug("5.4", "generator", "global random state")
def sample_new_generator_when_none(logits, temperature=1.0, top_k=None, generator=None):
    """No generator given: a new torch.Generator() each call, so every call draws the same tokens and the
    notebook's torch.manual_seed does nothing. It passed."""
    return _sample(logits, temperature, top_k, generator if generator is not None else torch.Generator())


_OWN_STATE = torch.Generator().manual_seed(0)


@bug("5.4", "generator", "of your own")
def sample_own_state_when_none(logits, temperature=1.0, top_k=None, generator=None):
    """No generator given: one kept beside the function, so the notebook's torch.manual_seed does nothing."""
    return _sample(logits, temperature, top_k, generator or _OWN_STATE)


# ============================================================================ an ablation that leaves a trace
@bug("11.3", "not_restored", "_ablation", "still there")
@contextlib.contextmanager
def ablate_keeps_handle_on_module(model, layer, head):
    """The hook's handle kept on the attention module, and left there: "leave no trace". It passed: only public
    attributes were compared."""
    attn = model.blocks[layer].attn
    size = attn.head_dim

    def hook(module, inputs):
        x = inputs[0].clone()
        x[..., head * size:(head + 1) * size] = 0
        return (x,)

    attn._ablation = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        attn._ablation.remove()
