"""Student attempts whose only fault is a rounding (a half-precision or bfloat16 step, a .round() to a few decimals),
and a structural slip of the same size (LayerNorm's eps), from the twenty-fourth search of the checks (2026-11-30).

Before, a rounding was told a mistake of structure it does not make ("the weights are not a softmax", "some
weights are negative", "check the order", "split the columns into three blocks"), and a float16 step inside a
float64 pass passed (the float64 pass compared at float32's tolerance).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from course_lib.attention import MaskedAttention, MultiHeadMaskedAttention, merge_heads, split_heads
from course_lib.model import TransformerBlock

BUGGY, CORRECT, bug, correct = new_bank()


def _bfloat16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


def _half(t: torch.Tensor) -> torch.Tensor:
    return t.half().to(t.dtype)


@bug("1.2", "precision", "rounds", avoids=("scores going into the softmax",))
def toy_weights_to_two_decimals(query, keys, values):
    weights = (torch.softmax(keys @ query, dim=0) * 100).round() / 100
    return weights @ values


@bug("1.3", "precision", "half precision", avoids=("combine them with v",))
def sdpa_weights_in_half(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return _half(scores.softmax(dim=-1)) @ v


@bug("2.2", "precision", "half precision", avoids=("not a softmax", "row sums"))
class MaskedWeightsInBfloat16(MaskedAttention):
    def forward(self, x):
        length = x.shape[1]
        scores = (self.query(x) @ self.key(x).transpose(-2, -1) / math.sqrt(self.embed_dim)).masked_fill(
            ~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(_bfloat16(scores.softmax(dim=-1)))
        return self.proj_dropout(self.proj(weights @ self.value(x)))


@bug("3.3", "precision", "half precision", avoids=("negative",))
class HeadsMergedInHalf(MultiHeadMaskedAttention):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = (split_heads(layer(x), self.num_heads) for layer in (self.query, self.key, self.value))
        scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(
            ~self.mask[:length, :length], float("-inf"))
        merged = _half(merge_heads(self.attn_dropout(scores.softmax(dim=-1)) @ v))
        return self.proj_dropout(self.proj(merged))


class _PreNorm(TransformerBlock):
    def sublayers(self, x, rounded, norm):
        x = x + rounded(self.attn(norm(self.ln1, x)))
        return x + rounded(self.mlp(norm(self.ln2, x)))


@bug("4.2", "precision", "half precision", avoids=("check the order",))
class BlockSublayersInBfloat16(_PreNorm):
    def forward(self, x):
        return self.sublayers(x, _bfloat16, lambda ln, t: ln(t))


@bug("4.2", "epsilon", "epsilon of 0.01")
class BlockWithLayerNormEpsilon(_PreNorm):
    def forward(self, x):
        return self.sublayers(x, lambda t: t, lambda ln, t: F.layer_norm(t, ln.normalized_shape, ln.weight, ln.bias,
                                                                         1e-2))


@correct("4.2")
class BlockWithItsOwnLayerNorm(_PreNorm):   # nn.LayerNorm's own arithmetic, written out
    def forward(self, x):
        def norm(ln, t):
            mean, var = t.mean(-1, keepdim=True), t.var(-1, unbiased=False, keepdim=True)
            return (t - mean) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias
        return self.sublayers(x, lambda t: t, norm)


@bug("7.1", "precision", "half precision", avoids=("split the columns",))
def split_through_half(weight):
    return tuple(_half(block.T) for block in weight.split(weight.shape[0], dim=1))


@bug("11.1", "precision", "lower precision")
def previous_token_score_in_half(weights):
    return _half(weights).diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(0, 2))
