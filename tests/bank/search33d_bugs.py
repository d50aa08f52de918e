"""Round 33 (tester), part d."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bank.attempts import new_bank
from bank.search32r_bugs import _attend
from course_lib.attention import MultiHeadMaskedAttention, merge_heads, split_heads
from course_lib.modern import GroupedQueryAttention, SwiGLU

BUGGY, CORRECT, bug, correct = new_bank()
NEG = float("-inf")


@correct("9.6")
class GQAExtraOwnOption(GroupedQueryAttention):
    """A constructor with an option modern's has not (bias, default False), the rest passed on."""
    def __init__(self, embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta=10000.0, *, bias=False, **options):
        super().__init__(embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta, **options)
        if bias:
            self.query.bias = nn.Parameter(torch.zeros(self.query.out_features))

    def forward(self, x, cache=None):
        return _attend(self, x, cache, dropout_p=self.dropout_rate if self.training else 0.0)


@correct("3.3")
class MultiRecordsWeightsInABuffer(MultiHeadMaskedAttention):
    """The last attention weights recorded in a non-persistent buffer (re-registered at each call)."""
    def forward(self, x):
        length = x.shape[1]
        q, k, v = (split_heads(lin(x), self.num_heads) for lin in (self.query, self.key, self.value))
        w = (q @ k.transpose(-2, -1) / self.head_dim ** 0.5).masked_fill(~self.mask[:length, :length], NEG).softmax(-1)
        self.register_buffer("attn_weights", w.detach(), persistent=False)
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(w) @ v)))


@correct("9.4")
class SwiGLURecordsGateInABuffer(SwiGLU):
    def forward(self, x):
        gate = F.silu(self.gate(x))
        self.register_buffer("last_gate", gate.detach(), persistent=False)
        return self.down(gate * self.up(x))
