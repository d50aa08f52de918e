"""Attempts of the thirtieth search's classes C1, C2, C4, C5: a value kept from the first call named by its symptom,
heads of num_heads features (torch.split's size read as a count), a LayerNorm without its learned weight and bias,
one KVCache shared by every block. Each class with variants, and right attempts a probe for it could refuse."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bank.attempts import new_bank
from course_lib.attention import KVCache, MultiHeadMaskedAttention, merge_heads, split_heads
from course_lib.model import GPT, TransformerBlock

BUGGY, CORRECT, bug, correct = new_bank()

_NEG = float("-inf")


def _sdpa(q, k, v, mask, scale):
    s = q @ k.transpose(-2, -1) * scale
    if mask is not None:
        s = s.masked_fill(~mask, _NEG)
    return s.softmax(-1) @ v


# ============================================================================ C1: a value kept from the first call

@bug("1.3", "kept_state", "earlier call")
def sdpa_temperature_learned_once(q, k, v, mask=None, _t=[None]):   # noqa: B006 - the kept default is the point
    """The scale taken from the first call's d and kept in a default list (r30)."""
    if _t[0] is None:
        _t[0] = math.sqrt(q.shape[-1])
    return _sdpa(q, k, v, mask, 1 / _t[0])


_SCALE = None


@bug("1.3", "kept_state", "earlier call")
def sdpa_scale_in_a_global_set_once(q, k, v, mask=None):
    """`global _SCALE`, set on the first call only."""
    global _SCALE
    if _SCALE is None:
        _SCALE = q.shape[-1] ** -0.5
    return _sdpa(q, k, v, mask, _SCALE)


@bug("1.3", "kept_state", "earlier call")
def sdpa_scale_on_the_function(q, k, v, mask=None):
    """An attribute of the function, made on the first call (hasattr): no default, no global of its own."""
    if not hasattr(sdpa_scale_on_the_function, "d"):
        sdpa_scale_on_the_function.d = q.shape[-1]
    return _sdpa(q, k, v, mask, sdpa_scale_on_the_function.d ** -0.5)


@correct("1.3")
def sdpa_scale_memoised_per_d(q, k, v, mask=None, _scales={}):   # noqa: B006 - the kept default is the point
    """A cache of the scale keyed on d: kept between calls, and right."""
    d = q.shape[-1]
    if d not in _scales:
        _scales[d] = 1 / math.sqrt(d)
    return _sdpa(q, k, v, mask, _scales[d])


@correct("1.3")
def sdpa_counting_its_calls(q, k, v, mask=None, _calls=[0]):   # noqa: B006 - the kept default is the point
    """A call counter kept in a default: state that never reaches the result."""
    _calls[0] += 1
    return _sdpa(q, k, v, mask, q.shape[-1] ** -0.5)


@bug("3.3", "kept_state", "earlier call")
class MultiScaleKeptOnTheClass(MultiHeadMaskedAttention):
    """1/sqrt(head_dim) computed once, on the first layer called, and kept on the class (r30)."""

    _scale = None

    def forward(self, x):
        if MultiScaleKeptOnTheClass._scale is None:
            MultiScaleKeptOnTheClass._scale = self.head_dim ** -0.5
        length = x.shape[1]
        q, k, v = (split_heads(f(x), self.num_heads) for f in (self.query, self.key, self.value))
        s = (q @ k.transpose(-2, -1) * MultiScaleKeptOnTheClass._scale).masked_fill(~self.mask[:length, :length], _NEG)
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(s.softmax(-1)) @ v)))


@bug("3.3", "kept_state", "earlier call")
class MultiHeadDimKeptAtTheFirstBuild(MultiHeadMaskedAttention):
    """The scale worked out in __init__ of the first layer built, stored on the class (type(self).scale)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "scale" not in vars(type(self)):
            type(self).scale = self.head_dim ** -0.5

    def forward(self, x):
        length = x.shape[1]
        q, k, v = (split_heads(f(x), self.num_heads) for f in (self.query, self.key, self.value))
        s = (q @ k.transpose(-2, -1) * self.scale).masked_fill(~self.mask[:length, :length], _NEG)
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(s.softmax(-1)) @ v)))


@correct("3.3")
class MultiScaleTablePerHeadDim(MultiHeadMaskedAttention):
    """A class-level table of scales keyed on head_dim: shared by every layer, and right."""

    _scales: dict = {}

    def forward(self, x):
        scale = self._scales.setdefault(self.head_dim, self.head_dim ** -0.5)
        length = x.shape[1]
        q, k, v = (split_heads(f(x), self.num_heads) for f in (self.query, self.key, self.value))
        s = (q @ k.transpose(-2, -1) * scale).masked_fill(~self.mask[:length, :length], _NEG)
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(s.softmax(-1)) @ v)))


def _online(x, block_size, blocks, end=None):
    m = torch.full(x.shape[:-1], _NEG, dtype=x.dtype, device=x.device)
    total = torch.zeros_like(m)
    for b in range(blocks):
        blk = x[..., b * block_size:min((b + 1) * block_size, end or x.shape[-1])]
        if blk.shape[-1] == 0:
            break
        m_new = torch.maximum(m, blk.amax(-1))
        ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        total = total * torch.exp(m - ref) + torch.exp(blk - ref[..., None]).sum(-1)
        m = m_new
    ref = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return torch.exp(x - ref[..., None]) / total[..., None]


@bug("10.1", "kept_state", "earlier call")
def online_softmax_block_count_kept(x, block_size, _seen={}):   # noqa: B006 - the kept default is the point
    """The number of blocks worked out on the first call for each block size and kept (r30)."""
    if block_size not in _seen:
        _seen[block_size] = -(-x.shape[-1] // block_size)
    return _online(x, block_size, _seen[block_size])


_ROW = []


@bug("10.1", "kept_state", "earlier call")
def online_softmax_row_length_kept(x, block_size):
    """The row's length read once, into a global list, and the blocks cut at it ever after."""
    if not _ROW:
        _ROW.append(x.shape[-1])
    return _online(x, block_size, -(-x.shape[-1] // block_size), end=_ROW[0])


@correct("10.1")
def online_softmax_block_count_per_shape(x, block_size, _seen={}):   # noqa: B006 - the kept default is the point
    """A cache of the block count keyed on (L, block_size): kept, and right."""
    key = (x.shape[-1], block_size)
    if key not in _seen:
        _seen[key] = -(-x.shape[-1] // block_size)
    return _online(x, block_size, _seen[key])


# ============================================================================ C2: heads of num_heads features

def _heads_attention(self, x, split, scale):
    length = x.shape[1]
    q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
    s = q @ k.transpose(-2, -1) * scale(q)
    s = s.masked_fill(~self.mask[:length, :length], _NEG)
    out = self.attn_dropout(s.softmax(-1)) @ v
    return self.proj_dropout(self.proj(torch.cat(out.unbind(1), dim=-1)))


@bug("3.3", "head_split", "split", "heads of")
class MultiHeadsSplitWithSplitSize(MultiHeadMaskedAttention):
    """torch.split(t, num_heads, -1) stacked: pieces of num_heads features each (r30)."""

    def forward(self, x):
        return _heads_attention(self, x, lambda t: torch.stack(torch.split(t, self.num_heads, dim=-1), dim=1),
                                lambda q: q.shape[-1] ** -0.5)


@bug("3.3", "head_split", "split", "heads of")
class MultiHeadsViewWithTheSizesSwapped(MultiHeadMaskedAttention):
    """view(N, L, -1, num_heads).transpose(1, 2), scaled by 1/sqrt(self.head_dim): the sizes in the wrong order."""

    def forward(self, x):
        n, length, _ = x.shape
        return _heads_attention(self, x, lambda t: t.view(n, length, -1, self.num_heads).transpose(1, 2),
                                lambda q: self.head_dim ** -0.5)


@correct("3.3")
class MultiHeadsSplitByHeadDim(MultiHeadMaskedAttention):
    """torch.split(t, head_dim, -1) stacked: pieces of head_dim features, as many as the heads."""

    def forward(self, x):
        return _heads_attention(self, x, lambda t: torch.stack(torch.split(t, self.head_dim, dim=-1), dim=1),
                                lambda q: q.shape[-1] ** -0.5)


@correct("3.3")
class MultiHeadsChunked(MultiHeadMaskedAttention):
    """torch.chunk(t, num_heads, -1): num_heads pieces."""

    def forward(self, x):
        return _heads_attention(self, x, lambda t: torch.stack(t.chunk(self.num_heads, dim=-1), dim=1),
                                lambda q: self.head_dim ** -0.5)


# ============================================================================ C4: a LayerNorm without its weight and bias

@bug("4.2", "norm_placement", "weight")
class BlockLayerNormWithoutItsParameters(TransformerBlock):
    """F.layer_norm without ln1/ln2's weight and bias (r30)."""

    def forward(self, x):
        e = x.shape[-1]
        x = x + self.attn(F.layer_norm(x, (e,), eps=self.ln1.eps))
        return x + self.mlp(F.layer_norm(x, (e,), eps=self.ln2.eps))


@bug("4.2", "norm_placement", "weight", norm_first=False)
class PostBlockLayerNormWithoutItsParameters(TransformerBlock):
    """Post-norm, F.layer_norm without the norms' weight and bias (r30)."""

    def forward(self, x):
        e = x.shape[-1:]
        x = F.layer_norm(x + self.attn(x), e, eps=self.ln1.eps)
        return F.layer_norm(x + self.mlp(x), e, eps=self.ln2.eps)


@bug("4.2", "norm_placement", "ln2's learned weight")
class BlockSecondNormWithoutItsParameters(TransformerBlock):
    """self.ln1 for the attention, a plain LayerNorm without affine parameters for the feed-forward."""

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(nn.functional.layer_norm(x, self.ln2.normalized_shape))


@correct("4.2")
class BlockFunctionalLayerNormWithItsParameters(TransformerBlock):
    """F.layer_norm given each norm's weight, bias and eps: the same as calling it."""

    def forward(self, x):
        norm = lambda ln, t: F.layer_norm(t, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
        x = x + self.attn(norm(self.ln1, x))
        return x + self.mlp(norm(self.ln2, x))


@bug("4.3", "final_norm", "weight")
class GPTFinalNormWithoutItsParameters(GPT):
    """F.layer_norm for ln_f without its weight and bias (r30)."""

    def forward(self, idx):
        n, length = idx.shape
        if length > self.config.max_tokens:
            raise ValueError(f"idx: {length} tokens is longer than max_tokens={self.config.max_tokens}; crop it")
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(length))
        for block in self.blocks:
            x = block(x)
        return self.head(F.layer_norm(x, x.shape[-1:], eps=self.ln_f.eps))


@bug("4.3", "final_norm", "weight")
class GPTFinalNormNotAffine(GPT):
    """A LayerNorm built without elementwise_affine for the final norm: no weight, no bias."""

    def forward(self, idx):
        length = idx.shape[1]
        if length > self.config.max_tokens:
            raise ValueError(f"idx: {length} tokens is longer than max_tokens={self.config.max_tokens}; crop it")
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(length))
        for block in self.blocks:
            x = block(x)
        plain = nn.LayerNorm(x.shape[-1], elementwise_affine=False).to(x.device, x.dtype)
        return self.head(plain(x))


@correct("4.3")
class GPTFinalNormFunctionalWithItsParameters(GPT):
    """The final norm as F.layer_norm given ln_f's weight, bias and eps."""

    def forward(self, idx):
        length = idx.shape[1]
        if length > self.config.max_tokens:
            raise ValueError(f"idx: {length} tokens is longer than max_tokens={self.config.max_tokens}; crop it")
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(length))
        for block in self.blocks:
            x = block(x)
        ln = self.ln_f
        return self.head(F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps))


# ============================================================================ C5: one KVCache for every block

def _greedy_with(model, idx, new, cache):
    logits = model(idx, cache)
    for _ in range(new):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], 1)
        logits = model(nxt, cache)
    return idx


@bug("6.2", "kv_cache", "same cache object", "one KVCache per block")
def cached_one_cache_object_for_every_block(model, idx, max_new_tokens):
    """[KVCache(...)] * num_blocks: one cache shared by all the blocks (r30)."""
    return _greedy_with(model, idx, max_new_tokens, [KVCache(model.config.max_tokens)] * len(model.blocks))


@bug("6.2", "kv_cache", "same cache object", "one KVCache per block")
def cached_one_cache_reused_by_reference(model, idx, max_new_tokens):
    """The first block's cache, aliased for every block (r30)."""
    first = model.new_cache()[0]
    return _greedy_with(model, idx, max_new_tokens, [first for _ in model.blocks])


def _through_blocks(model, ids, caches, start):
    x = model.token_embedding(ids) + model.position_encoding(ids.shape[1], start)
    for block, cache in zip(model.blocks, caches):
        x = block(x, cache)
    return model.head(model.ln_f(x))


@bug("6.2", "kv_cache", "same cache object", "one KVCache per block")
def cached_blocks_by_hand_with_one_cache(model, idx, max_new_tokens):
    """The blocks called by hand (no model.forward), every one given the same KVCache."""
    one = KVCache(model.config.max_tokens)
    caches = [one] * len(model.blocks)
    logits = _through_blocks(model, idx, caches, 0)
    seen = idx.shape[1]
    for _ in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], 1)
        logits = _through_blocks(model, nxt, caches, seen)
        seen += 1
    return idx


@correct("6.2")
def cached_blocks_by_hand_with_their_caches(model, idx, max_new_tokens):
    """The blocks called by hand, each with its own cache of model.new_cache()."""
    caches = model.new_cache()
    logits = _through_blocks(model, idx, caches, 0)
    for _ in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        start = caches[0].length
        idx = torch.cat([idx, nxt], 1)
        logits = _through_blocks(model, nxt, caches, start)
    return idx


@correct("6.2")
def cached_as_a_tuple_of_new_caches(model, idx, max_new_tokens):
    """The caches as a tuple, each made on its own."""
    return _greedy_with(model, idx, max_new_tokens, tuple(KVCache(model.config.max_tokens) for _ in model.blocks))


# ============================================================================ minor: the words of two messages

@bug("1.3", "normalization", "1/sqrt(d)", "after the softmax")
def sdpa_values_scaled_too(q, k, v, mask=None):
    """Scales the values by 1/sqrt(d) as well as the scores (r30)."""
    d = q.shape[-1]
    return _sdpa(q, k, v / math.sqrt(d), mask, d ** -0.5)


@bug("1.3", "normalization", "factor of 0.9", "after the softmax")
def sdpa_output_damped(q, k, v, mask=None):
    """The output multiplied by 0.9 (a leftover dropout keep-rate)."""
    return 0.9 * _sdpa(q, k, v, mask, q.shape[-1] ** -0.5)


@bug("4.1", "scale", "embed_dim / 2", "multiply by 2 again")
def table_frequency_exponent_over_half(max_tokens, embed_dim):
    """2i / (embed_dim / 2): the exponent over the number of pairs (r30)."""
    i = torch.arange(embed_dim // 2, dtype=torch.float32)
    freq = 10000 ** (-2 * i / (embed_dim // 2))
    angles = torch.arange(max_tokens, dtype=torch.float32)[:, None] * freq
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)


# ============================================================================ 12.3: a normaliser that starts at ones

@bug("12.3", "normalization", "starts at ones", "zeros")
def linear_normaliser_starting_at_one(q, k, v):
    """z starts at ones (like a count), not zeros."""
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    s = torch.zeros(*q.shape[:-2], q.shape[-1], v.shape[-1], dtype=q.dtype, device=q.device)
    z = torch.ones(*q.shape[:-2], q.shape[-1], dtype=q.dtype, device=q.device)
    outs = []
    for i in range(q.shape[-2]):
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        outs.append((fq[..., i, None, :] @ s).squeeze(-2) / ((fq[..., i, :] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outs, -2)
