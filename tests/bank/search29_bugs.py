"""Student attempts from the twenty-ninth search (2026-11-30), written apart from the tester's own: each wrong one
was misjudged before (passed, or named another mistake).

A row that starts with whole blocks of -inf (10.1: NaN from exp(-inf - (-inf))). A tensor made on the CPU inside
forward (2.2, 3.3, 12.2). Copies of the right heads in the wrong order (9.5). A RoPE table whose slow pairs turn at
the wrong speed (9.1: not rounding). And mistakes told only by their numbers before (9.6, 12.2, 12.3, 11.1, 9.3,
2.2). Right code beside each, where a new probe could refuse it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank

BUGGY, CORRECT, bug, correct = new_bank()

_NEG = float("-inf")


# ============================================================================ 10.1: rows that start masked

@bug("10.1", "nan", "-inf", "NaN", "guard")
def online_softmax_row_by_row_unguarded(x, block_size):
    """Row by row in Python lists of blocks; m starts at -inf and is subtracted as it is."""
    flat = x.reshape(-1, x.shape[-1])
    rows = []
    for row in flat:
        m, total = torch.tensor(_NEG, dtype=x.dtype), torch.tensor(0.0, dtype=x.dtype)
        for block in row.split(block_size):
            new_m = torch.max(m, block.max())
            total = total * (m - new_m).exp() + (block - new_m).exp().sum()
            m = new_m
        rows.append((row - m).exp() / total)
    return torch.stack(rows).reshape(x.shape)


@correct("10.1")
def online_softmax_row_by_row_guarded(x, block_size):
    """The same, with the maximum taken as 0 while the row has seen only -inf."""
    flat = x.reshape(-1, x.shape[-1])
    rows = []
    for row in flat:
        m, total = torch.tensor(_NEG, dtype=x.dtype), torch.tensor(0.0, dtype=x.dtype)
        for block in row.split(block_size):
            new_m = torch.max(m, block.max())
            shift = new_m if torch.isfinite(new_m) else torch.zeros_like(new_m)
            total = total * (m - shift).exp() + (block - shift).exp().sum()
            m = new_m
        shift = m if torch.isfinite(m) else torch.zeros_like(m)
        rows.append((row - shift).exp() / total)
    return torch.stack(rows).reshape(x.shape)


# ============================================================================ 2.2, 3.3, 12.2: a tensor made on the CPU

from course_lib import modern  # noqa: E402
from course_lib.attention import MaskedAttention, MultiHeadMaskedAttention, merge_heads, split_heads  # noqa: E402


@bug("2.2", "device", "device=x.device")
class MaskedAttentionWithPositionsFromArange(MaskedAttention):
    """The causal mask from two aranges compared, made on the CPU at every call (the buffer is not read)."""

    def forward(self, x):
        length = x.shape[1]
        position = torch.arange(length)
        future = position[None, :] > position[:, None]                          # (L, L), on the CPU
        s = self.query(x) @ self.key(x).transpose(-2, -1) / math.sqrt(self.embed_dim)
        w = self.attn_dropout(s.masked_fill(future, _NEG).softmax(dim=-1))
        return self.proj_dropout(self.proj(w @ self.value(x)))


@correct("2.2")
class MaskedAttentionWithPositionsOnTheDevice(MaskedAttention):
    """The same, with the aranges on x's device: right."""

    def forward(self, x):
        length = x.shape[1]
        position = torch.arange(length, device=x.device)
        future = position[None, :] > position[:, None]
        s = self.query(x) @ self.key(x).transpose(-2, -1) / math.sqrt(self.embed_dim)
        w = self.attn_dropout(s.masked_fill(future, _NEG).softmax(dim=-1))
        return self.proj_dropout(self.proj(w @ self.value(x)))


@bug("3.3", "device", "device=x.device")
class MultiHeadAttentionWithAnAdditiveBiasOnTheCpu(MultiHeadMaskedAttention):
    """An additive bias of -inf above the diagonal, from torch.full(...).triu(1) on the CPU, added to the scores."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = (split_heads(f(x), self.num_heads) for f in (self.query, self.key, self.value))
        bias = torch.full((length, length), _NEG).triu(1)                        # (L, L), on the CPU
        w = (q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) + bias).softmax(dim=-1)
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(w) @ v)))


@correct("3.3")
class MultiHeadAttentionWithTheBiasFromTheBuffer(MultiHeadMaskedAttention):
    """The same bias, made from the registered mask (it moves with the module): right."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = (split_heads(f(x), self.num_heads) for f in (self.query, self.key, self.value))
        keep = self.mask[:length, :length]
        bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, _NEG)
        w = (q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) + bias).softmax(dim=-1)
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(w) @ v)))


def _latent(layer, x, cache=None, *, mask_device=True, q_after_append=False, norm_both=False, positions_cpu=False):
    """MLA as the notebook asks, with one slip switched on: the mask's positions made on the CPU, the queries turned
    at the positions after the append, kv_a_layernorm over the latent and the rotary key together."""
    n, length, _ = x.shape
    dn, dr, heads = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads
    start = 0 if cache is None else cache.length
    q = layer.q_proj(x) if layer.q_lora_rank is None else layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    q_nope, q_rope = q.view(n, length, heads, dn + dr).transpose(1, 2).split([dn, dr], dim=-1)
    both = layer.kv_a_proj_with_mqa(x)                                          # (N, L, rank + dr)
    if norm_both:
        both = F.layer_norm(both, both.shape[-1:]) if not hasattr(layer.kv_a_layernorm, "weight") else \
            both * torch.rsqrt(both.pow(2).mean(-1, keepdim=True) + layer.kv_a_layernorm.eps) * torch.cat(
                [layer.kv_a_layernorm.weight, torch.ones(dr, dtype=x.dtype, device=x.device)])
        latent, k_rope = both.split([layer.kv_lora_rank, dr], dim=-1)
    else:
        latent, k_rope = both.split([layer.kv_lora_rank, dr], dim=-1)
        latent = layer.kv_a_layernorm(latent)
    k_rope = modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    total = latent.shape[1]
    q_start = total if q_after_append else start
    q_rope = modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=q_start)
    k_nope, v = layer.kv_b_proj(latent).view(n, total, heads, dn + layer.v_head_dim).transpose(1, 2).split(
        [dn, layer.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_rope[:, None].expand(n, heads, total, dr)], dim=-1)
    scores = torch.cat([q_nope, q_rope], dim=-1) @ k.transpose(-2, -1) * layer.softmax_scale
    device = None if positions_cpu else x.device
    rows = torch.arange(start, start + length, device=device)
    later = torch.arange(total, device=device)[None, :] > rows[:, None]           # (L, T)
    out = scores.masked_fill(later, _NEG).softmax(dim=-1) @ v
    return layer.o_proj(out.transpose(1, 2).reshape(n, length, heads * layer.v_head_dim))


@bug("12.2", "device", "device=x.device")
def latent_attention_positions_on_the_cpu(layer, x, cache=None):
    """Query and key positions from torch.arange without device=x.device."""
    return _latent(layer, x, cache, positions_cpu=True)


@correct("12.2")
def latent_attention_positions_on_the_device(layer, x, cache=None):
    return _latent(layer, x, cache)


# ============================================================================ 9.5: copies of the heads in the wrong order

@bug("9.5", "kv_grouping", "wrong order", "h // groups", avoids=("not copies",))
def repeat_kv_by_rounded_position(x, groups):
    """Output head h reads the kv head at round(h * kv / (kv * groups)), rounded to the nearest: [0, 0, 1, 1, 1, 1]
    style orders where [0, 0, 0, 1, 1, 1] is right."""
    kv = x.shape[1]
    index = torch.tensor([min(kv - 1, round(h / groups)) for h in range(kv * groups)], device=x.device)
    return x.index_select(1, index)


@bug("9.5", "kv_grouping", "wrong order", "h // groups", avoids=("not copies",))
def repeat_kv_groups_reversed(x, groups):
    """Each group in reverse order of kv heads: [1, 1, 0, 0] for [0, 0, 1, 1]."""
    return x.flip(1).repeat_interleave(groups, dim=1)


# ============================================================================ 9.1: slow pairs at the wrong speed

@bug("9.1", "rope_frequencies", "wrong speed", avoids=("rounded",))
def rope_tables_slowing_long_wavelengths(head_dim, max_tokens, theta=10000.0):
    """A long-context habit: pairs whose wavelength 2*pi/w passes 2000 positions turn 8 times slower, the angles in
    float64 (so the tables are off by little at short lengths, only in those pairs)."""
    freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freq = torch.where(2 * math.pi / freq > 2000, freq / 8, freq)
    angles = torch.outer(torch.arange(max_tokens, dtype=torch.float64), freq).repeat(1, 2)
    return angles.cos().float(), angles.sin().float()


@correct("9.1")
def rope_tables_from_polar(head_dim, max_tokens, theta=10000.0):
    """torch.polar on float64 angles, then real and imaginary parts: right."""
    freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    turns = torch.polar(torch.ones(max_tokens, head_dim // 2, dtype=torch.float64),
                        torch.outer(torch.arange(max_tokens, dtype=torch.float64), freq))
    turns = torch.cat([turns, turns], dim=-1)
    return turns.real.float(), turns.imag.float()


# ============================================================================ 9.3: torch's default epsilon

from course_lib.modern import RMSNorm  # noqa: E402


@bug("9.3", "epsilon", "default", "self.eps")
class RMSNormThroughTorchsModule(RMSNorm):
    """torch.nn.RMSNorm's functional form with eps=None: torch.finfo(float32).eps, whatever self.eps says."""

    def forward(self, x):
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), eps=None).to(x.dtype)


@correct("9.3")
class RMSNormThroughTorchsFunction(RMSNorm):
    """The same with eps=self.eps: right."""

    def forward(self, x):
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), eps=self.eps).to(x.dtype)


# ============================================================================ 2.2: x @ W, the weight untransposed

@bug("2.2", "mismatch", "transposed", "weight.T")
class MaskedAttentionWithNumpyProducts(MaskedAttention):
    """numpy's habit: the queries, keys and values as x @ W with the layers' weights, the output through proj."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = (torch.einsum("nle,ef->nlf", x, layer.weight) for layer in (self.query, self.key, self.value))
        s = q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)
        w = self.attn_dropout(s.masked_fill(~self.mask[:length, :length], _NEG).softmax(dim=-1))
        return self.proj_dropout(self.proj(w @ v))


# ============================================================================ 9.6: every query head on kv head 0

from bank.modern_bugs import _GQAPlain  # noqa: E402
from course_lib.attention import causal_mask  # noqa: E402


@bug("9.6", "kv_grouping", "key/value head 0")
class GQAReadingTheFirstKvHeadOnly(_GQAPlain):
    """Multi-query attention by hand: k[:, 0] and v[:, 0] broadcast over the query heads with a None axis."""

    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q, k, v = self.normed(x)
        q, k = self.turn(q, k, start, x.shape[1])
        if cache is not None:
            k, v = cache.append(k, v)
        k0, v0 = k[:, 0][:, None], v[:, 0][:, None]                               # (N, 1, T, head_dim)
        s = q @ k0.transpose(-2, -1) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~causal_mask(k.shape[2])[start:].to(x.device), _NEG)
        return self.proj(merge_heads(s.softmax(dim=-1) @ v0))


# ============================================================================ 11.1: all the attention to the past

@bug("11.1", "score_offset", "every earlier key", "diagonal")
def previous_token_score_as_one_minus_self(weights):
    """1 minus the weight on itself, averaged over queries 1..L-1: every earlier key counted, not only i - 1."""
    own = weights.diagonal(dim1=-2, dim2=-1)                                    # (N, heads, L)
    return (1 - own[..., 1:]).mean(dim=-1).mean(dim=0)


# ============================================================================ 12.3: the normaliser's order, phi's 1

def _recurrent(fq, fk, v, *, z_first=False):
    """Linear attention token by token, with the states as (..., d, d_v) and (..., d); ``z_first``: the normaliser
    is read from z before token i is added to it (S after)."""
    s = fq.new_zeros(*fq.shape[:-2], fq.shape[-1], v.shape[-1])
    z = fq.new_zeros(*fq.shape[:-2], fq.shape[-1])
    outputs = []
    for i in range(fq.shape[-2]):
        q_i, k_i, v_i = fq[..., i, :], fk[..., i, :], v[..., i, :]
        below = torch.einsum("...d,...d->...", q_i, z)
        z = z + k_i
        s = s + torch.einsum("...d,...e->...de", k_i, v_i)
        if not z_first:
            below = torch.einsum("...d,...d->...", q_i, z)
        outputs.append(torch.einsum("...d,...de->...e", q_i, s) / (below[..., None] + 1e-6))
    return torch.stack(outputs, dim=-2)


@bug("12.3", "state_order", "normaliser", "token i")
def linear_attention_normaliser_from_the_last_step(q, k, v):
    """The denominator phi(q_i) . z taken at the top of the loop, before z += phi(k_i)."""
    return _recurrent(F.elu(q) + 1, F.elu(k) + 1, v, z_first=True)


@bug("12.3", "feature_map", "elu(x) + 1")
def linear_attention_feature_map_shifted_first(q, k, v):
    """phi written as F.elu(x + 1.0): the 1 added before the elu."""
    phi = lambda t: F.elu(t + 1.0)  # noqa: E731
    return _recurrent(phi(q), phi(k), v)


@correct("12.3")
def linear_attention_with_einsums(q, k, v):
    return _recurrent(F.elu(q) + 1, F.elu(k) + 1, v)


# ============================================================================ 12.2: queries after the append, the norm

@bug("12.2", "rope_positions", "after", "before the append")
def latent_attention_queries_turned_after_the_append(layer, x, cache=None):
    """The queries turned at the cache's length read after cache.append (L without a cache)."""
    return _latent(layer, x, cache, q_after_append=True)


@bug("12.2", "norm_placement", "only the latent")
def latent_attention_normalising_the_rotary_key_too(layer, x, cache=None):
    """kv_a_layernorm's RMS over the whole kv_a_proj_with_mqa output, k_rope included (a weight of 1 there)."""
    return _latent(layer, x, cache, norm_both=True)
