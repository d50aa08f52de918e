"""Student attempts from the twenty-fifth search of the checks (2026-11-30), a tester's bank written in other styles
than this one: each was misjudged or told only "wrong values" where its mistake can be named.

A causal mask applied when no mask is given (1.3: "the scores are wrong"); a block's residual stream doubled,
averaged or normalised (4.2: "check the order", now read with both sublayers answering zeros); a mean taken as a
sum (11.1, 11.2: only the numbers quoted, now "exactly L - 1 times"); 10.1's upside-down rescale guarded before
the first block ("no maximum subtracted"); results kept between calls by shape (10.1, 11.2, 9.5) or by
(length, window) (12.1): passed, or named another mistake. And right code in styles the bank did not hold.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from course_lib.model import TransformerBlock

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 1.3: no mask means no mask

@bug("1.3", "causal_mask", "mask=None means no mask")
def sdpa_causal_when_no_mask(q, k, v, mask=None):
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# ============================================================================ 4.2: the residual stream itself

class _PreNorm(TransformerBlock):
    def stream(self, x, add):
        x = add(x, self.attn(self.ln1(x)))
        return add(x, self.mlp(self.ln2(x)))


@bug("4.2", "residual", "4 times x")
class BlockResidualDoubled(_PreNorm):
    def forward(self, x):
        return self.stream(x, lambda stream, update: stream + stream + update)


@bug("4.2", "residual", "0.25 times x")
class BlockResidualAveraged(_PreNorm):
    def forward(self, x):
        return self.stream(x, lambda stream, update: (stream + update) / 2)


@bug("4.2", "residual", "ln2(x)")
class BlockFeedForwardOnTheNormalisedStream(_PreNorm):
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        return h + self.mlp(h)


# ============================================================================ 11.1, 11.2: a sum where a mean is meant

@bug("11.1", "scale", "exactly 6 times")
def previous_token_summed(weights):
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).sum(-1).mean(0)


@bug("11.2", "scale", "a sum where a mean is meant")
def induction_summed(weights, half):
    return weights.diagonal(offset=-(half - 1), dim1=-2, dim2=-1)[..., 1:].sum(-1).mean(0)


# ============================================================================ 10.1: the factor upside down, guarded

@bug("10.1", "online_rescale", "upside down")
def online_softmax_rescale_inverted_guarded(x, block_size):
    m = torch.full(x.shape[:-1], -math.inf, dtype=x.dtype)
    total = torch.zeros_like(m)
    for block in x.split(block_size, dim=-1):
        new = torch.maximum(m, block.amax(-1))
        factor = torch.where(torch.isinf(m), torch.zeros_like(m), torch.exp(new - m))   # exp(m_new - m_old)
        total = total * factor + torch.exp(block - new[..., None]).sum(-1)
        m = new
    return torch.exp(x - m[..., None]) / total[..., None]


# ============================================================================ results kept between calls

_KEPT: dict = {}


def _kept(key, compute):
    if key not in _KEPT:
        _KEPT[key] = compute()
    return _KEPT[key]


@bug("9.5", "kept_state", "keeps its result from an earlier call")
def repeat_kv_kept_by_shape(x, groups):
    return _kept(("9.5", x.shape, groups), lambda: x.repeat_interleave(groups, dim=1))


@bug("11.2", "kept_state", "keeps its result from an earlier call")
def induction_kept_by_shape(weights, half):
    return _kept(("11.2", weights.shape, half),
                 lambda: weights.diagonal(offset=-(half - 1), dim1=-2, dim2=-1)[..., 1:].mean(dim=(0, 2)))


@bug("12.1", "kept_state", "earlier call")   # right when called afresh: the sinks left out of the cache key
def window_mask_kept_without_its_sinks(length, window, sinks=0):
    def make():
        i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
        return ((i - j >= 0) & (i - j < window)) | ((j < sinks) & (j <= i))
    return _kept(("12.1", length, window), make)


# ============================================================================ right, in other styles

@bug("1.3", "device", "device")   # refiled: the text asks for new tensors on q's device (round 34)
def sdpa_additive_bias(q, k, v, mask=None):
    bias = torch.zeros(q.shape[-2], k.shape[-2], dtype=q.dtype) if mask is None else \
        torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    return torch.softmax(torch.baddbmm(bias.expand(*q.shape[:-2], -1, -1).reshape(-1, *bias.shape[-2:]),
                                       q.reshape(-1, *q.shape[-2:]), k.reshape(-1, *k.shape[-2:]).mT,
                                       alpha=q.shape[-1] ** -0.5), dim=-1).reshape(*q.shape[:-1], k.shape[-2]) @ v


@correct("3.1")
def split_heads_as_strided(x, num_heads):
    n, length, e = x.shape
    x = x.contiguous()
    head_dim = e // num_heads
    return x.as_strided((n, num_heads, length, head_dim), (length * e, head_dim, e, 1), x.storage_offset())


@correct("9.2")
def apply_rotary_as_complex(x, cos, sin, offset=0):   # half-split pairs as complex numbers
    length, half = x.shape[-2], x.shape[-1] // 2
    turn = torch.complex(cos[offset:offset + length, :half].double(), sin[offset:offset + length, :half].double())
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * turn
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


@correct("12.1")
def window_mask_by_loops(length, window, sinks=0):
    mask = torch.zeros(length, length, dtype=torch.bool)
    for i in range(length):
        for j in range(i + 1):
            if i - j < window or j < sinks:
                mask[i, j] = True
    return mask
