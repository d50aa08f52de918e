"""Student attempts from a fourth scripted search (2026-11-29): scales of the scores and sizes written into the code.

Before, each was passed or named only "mismatch"; now each gets the diagnosis of the mistake it makes, with the
factor it uses where there is one. A few right controls with unusual but correct code keep the checks honest.
"""
from __future__ import annotations

import math

import torch.nn.functional as F

from bank.attempts import new_bank
from bank.search_bugs import _GivenGQA
from course_lib.attention import causal_mask, merge_heads, split_heads
from course_lib.modern import apply_rotary, repeat_kv

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 9.6: any factor, and one size written in
class _GQAScaled(_GivenGQA):
    """The notebook's steps; ``factor`` multiplies the scores before the softmax, ``after`` the weights after it."""

    def factor(self):
        return self.head_dim ** -0.5

    def after(self):
        return 1.0

    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        s = (q @ k.transpose(-2, -1)) * self.factor()                          # (N, heads, L, T)
        s = s.masked_fill(~causal_mask(k.shape[2])[start:].to(x.device), float("-inf"))
        return self.proj(merge_heads(F.softmax(s, dim=-1) * self.after() @ v))


@correct("9.6")
class GQAScaledQueriesAndKeysByAQuarterPower(_GQAScaled):
    def factor(self):
        return (self.head_dim ** -0.25) ** 2


@bug("9.6", "scale", "0.5946", "0.3536")
class GQADividedByAFourthRoot(_GQAScaled):
    def factor(self):
        return self.head_dim ** -0.25


@bug("9.6", "scale", "0.25")
class GQADividedBySqrtOfTwiceHeadDim(_GQAScaled):
    def factor(self):
        return (2 * self.head_dim) ** -0.5


@bug("9.6", "scale", "multiply")
class GQAMultipliedBySqrtHeadDim(_GQAScaled):
    def factor(self):
        return math.sqrt(self.head_dim)


@bug("9.6", "scale", "after the softmax")
class GQAScaledAfterTheSoftmax(_GQAScaled):
    def factor(self):
        return 1.0

    def after(self):
        return self.head_dim ** -0.5


@bug("9.6", "scale", "written into your code", "0.2887")
class GQAScaleOfEightWrittenIn(_GQAScaled):
    def factor(self):
        return 1 / math.sqrt(8)   # head_dim in the notebook's example


@bug("9.6", "head_split", "written into your code")
class GQAFourHeadsWrittenIn(_GQAScaled):
    def __init__(self, embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta=10000.0):
        super().__init__(embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta)
        self.num_heads = 4   # the notebook's example
