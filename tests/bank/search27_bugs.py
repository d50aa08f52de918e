"""Student attempts from the twenty-seventh and twenty-eighth searches of the checks (2026-11-30), in styles the
tester's bank did not hold: each was misjudged before.

State kept between calls by a module, or by a function that takes a model (2.2, 3.3, 6.2, 7.2, 9.3, 9.6: passed):
keys and values carried from call to call while they fit, a cache kept on the model, a running mean square, a
dropout mask drawn once. A factor kept from the first call
(1.3: "a factor of 0.3536"). And mistakes told only "values differ" or "none of the mistakes" (4.3, 5.2, 5.4, 10.3,
11.2, 11.3, 12.2), now named.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from bank.flash_bugs import _backward
from bank.modern_bugs import _GQAPlain
from bank.pairs_bugs import _latent
from course_lib import modern
from course_lib.attention import KVCache, MaskedAttention, MultiHeadMaskedAttention, merge_heads, split_heads
from course_lib.flash import FlashAttentionFunction
from course_lib.model import GPT
from course_lib.modern import RMSNorm

BUGGY, CORRECT, bug, correct = new_bank()

_SEEN: dict = {}


# ============================================================================ state kept between calls (modules)

@bug("2.2", "kept_state", "keeps something from one call to the next", "only on its inputs")
class MaskedAttentionThatRemembersItsKeys(MaskedAttention):
    """A KV cache nobody asked for: the keys and values of the last call go in front of the new ones."""

    def forward(self, x):
        k, v = self.key(x), self.value(x)                                     # (N, L, E)
        past = getattr(self, "past", None)
        if past is not None and past[0].shape[0] == x.shape[0] and past[0].shape[1] + x.shape[1] <= self.max_tokens:
            k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
        self.past = (k.detach(), v.detach())
        total, length = k.shape[1], x.shape[1]
        s = self.query(x) @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)    # (N, L, T)
        s = s.masked_fill(~self.mask[total - length:total, :total], float("-inf"))
        return self.proj_dropout(self.proj(self.attn_dropout(s.softmax(dim=-1)) @ v))


@bug("2.2", "kept_state", "same attention weights", "draws a new mask")
class MaskedAttentionWithOneDropoutMask(MaskedAttention):
    """The attention dropout mask drawn at the first training call, for the largest size, and sliced after."""

    def forward(self, x):
        n, length, _ = x.shape
        s = self.query(x) @ self.key(x).transpose(-2, -1) / math.sqrt(self.embed_dim)
        w = s.masked_fill(~self.mask[:length, :length], float("-inf")).softmax(dim=-1)
        if self.training and self.dropout_rate > 0:
            if getattr(self, "keep", None) is None or self.keep.shape[0] < n:
                self.keep = torch.rand(n, self.max_tokens, self.max_tokens) >= self.dropout_rate
            w = w * self.keep[:n, :length, :length] / (1 - self.dropout_rate)
        return self.proj_dropout(self.proj(w @ self.value(x)))


@bug("3.3", "kept_state", "keeps something from one call to the next")
class MultiHeadAttentionWithAHistory(MultiHeadMaskedAttention):
    """Every head's keys and values of earlier calls kept in a list, used while they fit."""

    def forward(self, x):
        q, k, v = (split_heads(f(x), self.num_heads) for f in (self.query, self.key, self.value))   # (N, H, L, d)
        history = self.__dict__.setdefault("history", [])
        if history and history[-1][0].shape[0] == x.shape[0] and history[-1][0].shape[2] + x.shape[1] <= \
                self.max_tokens:
            k, v = torch.cat([history[-1][0], k], 2), torch.cat([history[-1][1], v], 2)
        history.append((k.detach(), v.detach()))
        total, length = k.shape[2], x.shape[1]
        s = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        s = s.masked_fill(~self.mask[total - length:total, :total], float("-inf"))
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(s.softmax(-1)) @ v)))


@bug("9.3", "kept_state", "training mode", "keeps something from one call to the next")
class RMSNormWithARunningStatistic(RMSNorm):
    """BatchNorm's habit: a running mean square, updated in training and used in eval."""

    def forward(self, x):
        h = x.float()
        ms = h.pow(2).mean(-1, keepdim=True)
        if self.training:
            old = getattr(self, "running", None)
            self.running = ms.mean().detach() if old is None else 0.9 * old + 0.1 * ms.mean().detach()
        elif getattr(self, "running", None) is not None:
            ms = self.running.expand_as(ms)
        return (h * torch.rsqrt(ms + self.eps) * self.weight.float()).to(x.dtype)


@bug("9.6", "kept_state", "the cache the caller passes")
class GQAWithAHiddenCache(_GQAPlain):
    """cache=None still caches: a cache of its own, made at the first call and reused while it has room."""

    def forward(self, x, cache=None):
        if cache is None:
            mine = getattr(self, "mine", None)
            if mine is None or mine.length + x.shape[1] > self.max_tokens or self.mine_batch != x.shape[0]:
                self.mine, self.mine_batch = KVCache(self.max_tokens), x.shape[0]
            cache = self.mine
        return super().forward(x, cache)


# ============================================================================ state kept between calls (procedures)

def _greedy_into(model, idx, cache, max_new_tokens):
    """Greedy generation through ``cache``, whatever it already holds (the attempts' own slip is which cache)."""
    logits = model(idx, cache)
    for step in range(max_new_tokens):
        token = logits[:, -1].argmax(dim=-1, keepdim=True)                     # (N, 1)
        idx = torch.cat([idx, token], dim=1)
        if step + 1 < max_new_tokens:
            logits = model(token, cache)
    return idx


@bug("6.2", "kept_state", "keeps something from one call to the next")
@torch.no_grad()
def generate_with_a_cache_kept_per_model(model, idx, max_new_tokens):
    """The cache made once per model and handed to every later generation while it has room."""
    kept = _SEEN.get(("6.2", id(model)))   # (the model, its cache): the model kept alive, so its id is its own
    if kept is None or kept[0] is not model or kept[1][0].length + idx.shape[1] + max_new_tokens > \
            model.config.max_tokens:
        kept = _SEEN[("6.2", id(model))] = (model, model.new_cache())
    cache = kept[1]
    return _greedy_into(model, idx, cache, max_new_tokens)


@bug("7.2", "kept_state", "keeps something from one call to the next")
def attention_that_remembers_keys(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Each layer's keys and values of the last call kept in a dict, put in front of the new ones while they fit."""
    kept = _SEEN.get(("7.2", id(module)))   # (the module, its keys, its values)
    if attention_mask is None and kept is not None and kept[0] is module and kept[1].shape[:2] == key.shape[:2] \
            and kept[1].shape[2] + key.shape[2] <= 8:
        key, value = torch.cat([kept[1], key], dim=2), torch.cat([kept[2], value], dim=2)
    _SEEN[("7.2", id(module))] = (module, key.detach(), value.detach())
    lq, lk = query.shape[-2], key.shape[-2]
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq) if attention_mask is None else attention_mask
    s = (query @ key.transpose(-1, -2) * scaling).masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ value).transpose(1, 2), None


@bug("7.2", "device", "device=")
def attention_with_its_mask_on_the_cpu(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                       **kwargs):
    """The causal mask made without device=: right on a CPU, and a device mix on a GPU."""
    lq, lk = query.shape[-2], key.shape[-2]
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq) if attention_mask is None else attention_mask
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)   # (N, heads, Lq, d)
    return out.transpose(1, 2), None


# ============================================================================ the twenty-eighth search: state past the probe

@bug("2.2", "kept_state", "keeps something from one call to the next")
class MaskedAttentionThatRemembersOneSequence(MaskedAttention):
    """Keys and values carried for a batch of one only (a "generation" path): batches of two never show it."""

    def forward(self, x):
        k, v = self.key(x), self.value(x)                                     # (N, L, E)
        past = getattr(self, "past", None) if x.shape[0] == 1 else None
        if past is not None and past[0].shape[1] + x.shape[1] <= self.max_tokens:
            k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
        if x.shape[0] == 1:
            self.past = (k.detach(), v.detach())
        total, length = k.shape[1], x.shape[1]
        s = self.query(x) @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)    # (N, L, T)
        s = s.masked_fill(~self.mask[total - length:total, :total], float("-inf"))
        return self.proj_dropout(self.proj(self.attn_dropout(s.softmax(dim=-1)) @ v))


@bug("2.2", "kept_state", "keeps something from one call to the next")
class MaskedAttentionDropsAtEvalToo(MaskedAttention):
    """The last training call's dropout mask kept, and applied again in eval mode."""

    def forward(self, x):
        length = x.shape[1]
        s = self.query(x) @ self.key(x).transpose(-2, -1) / math.sqrt(self.embed_dim)
        w = s.masked_fill(~self.mask[:length, :length], float("-inf")).softmax(dim=-1)
        if self.training and self.dropout_rate > 0:
            self.keep = (torch.rand_like(w) >= self.dropout_rate) / (1 - self.dropout_rate)
        keep = getattr(self, "keep", None)
        w = w * keep if keep is not None and keep.shape == w.shape else w
        return self.proj_dropout(self.proj(w @ self.value(x)))


@bug("9.6", "kept_state", "the cache the caller passes")
class GQAReusesTheLastCachePassed(_GQAPlain):
    """cache=None takes the last cache a caller passed, while it has room."""

    def forward(self, x, cache=None):
        if cache is not None:
            self.last = cache
        elif getattr(self, "last", None) is not None and self.last.length + x.shape[1] <= self.max_tokens:
            cache = self.last
        return super().forward(x, cache)


@bug("6.2", "kept_state", "keeps something from one call to the next")
@torch.no_grad()
def generate_with_a_cache_kept_for_one_prompt(model, idx, max_new_tokens):
    """The cache kept per model for a batch of one only, handed on while it has room."""
    kept = _SEEN.get(("6.2b", id(model))) if idx.shape[0] == 1 else None   # [the model, its cache, tokens in it]
    if idx.shape[0] == 1 and (kept is None or kept[0] is not model or kept[2] + idx.shape[1] + max_new_tokens
                              > model.config.max_tokens):
        kept = _SEEN[("6.2b", id(model))] = [model, model.new_cache(), 0]
    if kept is not None:
        kept[2] += idx.shape[1] + max_new_tokens - 1
    cache = kept[1] if kept is not None else model.new_cache()
    return _greedy_into(model, idx, cache, max_new_tokens)


@correct("7.2")
def attention_with_its_mask_on_the_layers_device(module, query, key, value, attention_mask, scaling=None,
                                                 dropout=0.0, **kwargs):
    """The mask made on the layer's device (its weights'), which is the query's in every real call."""
    lq, lk = query.shape[-2], key.shape[-2]
    device = next(module.parameters()).device
    mask = torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq) if attention_mask is None \
        else attention_mask
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)   # (N, heads, Lq, d)
    return out.transpose(1, 2), None


_CALLS: list = []


@bug("1.3", "scale", "0.3536", avoids=("earlier call",))
def sdpa_scale_of_eight_written_in_beside_a_log(q, k, v, mask=None):
    """1/sqrt(8) written in; a log of the shapes kept beside it (state, but not the factor's)."""
    _CALLS.append(tuple(q.shape))
    s = q @ k.transpose(-2, -1) / math.sqrt(8)
    if mask is not None:
        s = s.masked_fill(mask == 0, float("-inf"))
    return s.softmax(-1) @ v


class _ScaledAttention:
    scales: dict = {}   # one per batch layout, on the class, computed once

    def __call__(self, q, k, v, mask=None):
        s = q @ k.transpose(-2, -1) * type(self).scales.setdefault(q.shape[:-2], q.shape[-1] ** -0.5)
        if mask is not None:
            s = s.masked_fill(mask == 0, float("-inf"))
        return s.softmax(-1) @ v


sdpa_scale_kept_on_the_class = _ScaledAttention()
sdpa_scale_kept_on_the_class.__name__ = "sdpa_scale_kept_on_the_class"
bug("1.3", "kept_state", "earlier call")(sdpa_scale_kept_on_the_class)


# ============================================================================ 1.3: a factor kept from the first call

@bug("1.3", "kept_state", "earlier call", avoids=("Check how (and where)",))
def sdpa_scale_remembered(q, k, v, mask=None, _scales={}):   # noqa: B006 - the mutable default is the mistake
    scale = _scales.setdefault(q.shape[:-2], 1 / math.sqrt(q.shape[-1]))   # one per batch layout, computed once
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(mask == 0, float("-inf"))
    return torch.matmul(F.softmax(s, dim=-1), v)


# ============================================================================ mistakes now named

class _Embedded(GPT):
    def forward(self, idx):
        length = idx.shape[1]
        if length > self.config.max_tokens:
            raise ValueError(f"idx has {length} tokens, more than max_tokens={self.config.max_tokens}")
        return self.body(self.dropout(self.token_embedding(idx)), self.position_encoding(length))


@bug("4.3", "positions", "after the blocks", "once")
class GPTPositionsBeforeTheFinalNorm(_Embedded):
    def body(self, x, pos):
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x + pos))


@bug("4.3", "positions", "before every block", "once")
class GPTPositionsInEveryBlock(_Embedded):
    def body(self, x, pos):
        for block in self.blocks:
            x = block(x + pos)
        return self.head(self.ln_f(x))


@bug("5.2", "target_shift", "another order", "flatten both the same way")
def loss_with_targets_read_down_the_columns(logits, targets):
    vocab = logits.shape[-1]
    return F.cross_entropy(logits.view(-1, vocab), targets.t().flatten())


@bug("5.4", "dtype", "not their positions", "argmax")
def sample_returns_the_top_logit(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return torch.max(logits, dim=-1).values
    scaled = logits / temperature
    if top_k is not None:
        kth = torch.topk(scaled, min(top_k, scaled.shape[-1]), dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.multinomial(F.softmax(scaled, dim=-1), 1, generator=generator)[:, 0]


@bug("10.3", "gradient", "each other's", "dq, dk, dv")
class BackwardReturnsKeysFirst(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        dq, dk, dv, *rest = _backward(ctx, grad_out)
        return (dk, dq, dv, *rest)


@bug("11.2", "score_positions", "drop one entry")
def induction_score_drops_half_of_the_diagonal(weights, half):
    diagonal = torch.diagonal(weights, offset=1 - half, dim1=2, dim2=3)      # (N, heads, L - half + 1)
    return diagonal[:, :, half:].mean(dim=(0, 2))


@bug("11.2", "score_positions", "first half", "dropped")
def induction_score_from_the_lower_left_block(weights, half):
    corner = weights[:, :, half:, :half]                                      # queries of the second half
    return torch.diagonal(corner, offset=1, dim1=-2, dim2=-1).mean(dim=(0, -1))


@bug("11.3", "ablation_slice", "swapped")
@contextlib.contextmanager
def ablate_head_arguments_swapped(model, layer, head):
    attn = model.blocks[head].attn
    columns = slice(layer * attn.head_dim, (layer + 1) * attn.head_dim)
    saved = attn.proj.weight[:, columns].detach().clone()
    with torch.no_grad():
        attn.proj.weight[:, columns] = 0.0
    try:
        yield model
    finally:
        with torch.no_grad():
            attn.proj.weight[:, columns] = saved


@bug("12.2", "rope_positions", "KEYS", "offset=start")
def latent_attention_keys_turned_from_zero(layer, x, cache=None):
    n, length, _ = x.shape
    start = 0 if cache is None else cache.length
    dn, dr, heads = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads
    if cache is None:
        return _latent(layer, x)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], dim=-1)
    k_rope = modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin)     # offset left at 0
    latent, k_rope = cache.append(layer.kv_a_layernorm(latent), k_rope)
    q = layer.q_proj(x) if layer.q_lora_rank is None else layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    q_nope, q_rope = q.view(n, length, heads, dn + dr).transpose(1, 2).split([dn, dr], dim=-1)
    q_rope = modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    total = latent.shape[1]
    kv = layer.kv_b_proj(latent).view(n, total, heads, dn + layer.v_head_dim).transpose(1, 2)
    k_nope, v = kv.split([dn, layer.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_rope[:, None].expand(n, heads, total, dr)], dim=-1)
    scores = torch.cat([q_nope, q_rope], dim=-1) @ k.transpose(-2, -1) * layer.softmax_scale
    allowed = torch.ones(total, total, dtype=torch.bool).tril()[start:]
    out = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ v
    return layer.o_proj(out.transpose(1, 2).reshape(n, length, heads * layer.v_head_dim))


# ============================================================================ right code that must keep passing

@correct("10.1")
def online_softmax_guarded_by_nan_to_num(x, block_size):
    """The guard written as nan_to_num on the factor: exp(-inf - (-inf)) is NaN only while nothing was seen."""
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):
        chunk = x[..., start:start + block_size]
        m_next = torch.maximum(m, chunk.amax(dim=-1))
        safe = torch.where(torch.isinf(m_next), torch.zeros_like(m_next), m_next)
        l = l * torch.exp(m - safe).nan_to_num(0.0) + torch.exp(chunk - safe[..., None]).sum(-1)
        m = m_next
    return torch.exp(x - m[..., None]) / l[..., None]


@correct("9.3")
class RMSNormSameInEveryMode(RMSNorm):
    """A train/eval branch that computes the same thing both ways."""

    def forward(self, x):
        h = x.float()
        ms = h.square().mean(-1, keepdim=True) if self.training else (h * h).mean(-1, keepdim=True)
        return (h * torch.rsqrt(ms + self.eps) * self.weight.float()).to(x.dtype)
