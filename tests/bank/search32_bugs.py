"""Round 32: a forward that changes its module's weights in place; a setting of the whole process left changed;
a Function whose backwards read a stack on the class.

A forward may read its weights, never write them: weight decay or a renormalisation done inside forward, a clamp
that keeps a weight in a range, ``.data = ...``. Before, only 9.3 and 12.2 looked for it; the other module
exercises named the next call's mismatch, or passed when each case built a fresh module and called it once. Now
every call of a student's module is ``mutation``, the weight named. A module that records what it likes in a
buffer or an attribute stays right.

A function that sets the default dtype or turns gradients off for the process and returns: the check put the
setting back and judged the numbers, so it passed, while the student's notebook ran on in float64 or without
gradients. Now ``global_setting``, the setting named.

10.3: the two forwards' backwards ran in reverse order only, where a stack on the class hands each its own
state; they now run in both orders.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bank.attempts import Attempt, new_bank
from bank.model_bugs import GivenBlock, GPTNoCache
from bank.modern_bugs import GQAWithMask
from bank.scale_bugs import _MaskedScaled, _MultiScaled
from bank.search31a_bugs import _backward_loops
from course_lib import flash
from course_lib.modern import SwiGLU

BUGGY, CORRECT, bug, correct = new_bank()


def _decay(module: nn.Module, rate: float = 1e-3) -> None:
    """Weight decay, done by the forward itself (the optimizer's job)."""
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(1 - rate)


@bug("2.2", "mutation", "in place", "self.")
class MaskedDecaysItsWeightsInForward(_MaskedScaled):
    def forward(self, x):
        out = super().forward(x)
        _decay(self)
        return out


@bug("3.3", "mutation", "in place", "self.")
class MultiRenormalisesTheProjectionInForward(_MultiScaled):
    def forward(self, x):
        self.proj.weight.data = F.normalize(self.proj.weight.data, dim=1)   # unit rows, "for stability"
        return super().forward(x)


@bug("4.2", "mutation", "in place", "self.")
class BlockDecaysItsWeightsInForward(GivenBlock):
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        _decay(self)
        return x


@bug("4.3", "mutation", "in place", "token_embedding")
class GPTClampsItsEmbeddingInForward(GPTNoCache):
    def forward(self, idx):
        self.token_embedding.weight.data.clamp_(-1.0, 1.0)   # "no embedding far from the others"
        return super().forward(idx)


@bug("9.4", "mutation", "in place", "self.")
class SwiGLUDecaysItsWeightsInForward(SwiGLU):
    def forward(self, x):
        out = self.down(F.silu(self.gate(x)) * self.up(x))
        _decay(self)
        return out


@bug("9.4", "mutation", "in place", "gate.weight")
class SwiGLUNormalisesTheGateRows(SwiGLU):
    def forward(self, x):
        with torch.no_grad():
            self.gate.weight.div_(self.gate.weight.norm(dim=1, keepdim=True))
        return self.down(F.silu(self.gate(x)) * self.up(x))


@bug("9.6", "mutation", "in place", "self.")
class GQADecaysItsWeightsInForward(GQAWithMask):
    def forward(self, x, cache=None):
        out = super().forward(x, cache)
        _decay(self, 1e-2)
        return out


@correct("9.4")
class SwiGLUCountsItsCallsInABuffer(SwiGLU):
    """A buffer and an attribute written by forward: what the module records is its own."""
    def __init__(self, embed_dim, hidden_dim):
        super().__init__(embed_dim, hidden_dim)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long), persistent=False)
        self.last_gate = None

    def forward(self, x):
        self.calls += 1
        gate = F.silu(self.gate(x))
        self.last_gate = gate.detach()
        return self.down(gate * self.up(x))


@correct("4.2")
class BlockWithANormalisedCopyOfNothing(GivenBlock):
    """Reads a weight into a new tensor (w = ...) and never writes it back."""
    def forward(self, x):
        scale = self.ln1.weight * 1.0          # a new tensor: the layer's weight is untouched
        h = F.layer_norm(x, (x.shape[-1],), scale, self.ln1.bias, self.ln1.eps)
        x = x + self.attn(h)
        return x + self.mlp(self.ln2(x))


# ============================================================================ 10.3: a stack on the class


class BackwardStackOnTheClass(torch.autograd.Function):
    """Pushes what the backward needs onto a list on the class and pops it in backward: right whenever the
    backwards run in reverse order (as autograd runs a model's layers), the other call's numbers when two losses'
    backwards run one after the other."""

    stack: list = []

    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_q=64, block_k=64):
        out, lse = flash.flash_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
        BackwardStackOnTheClass.stack.append((q, k, v, out, lse, causal, block_q, block_k))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, causal, block_q, block_k = BackwardStackOnTheClass.stack.pop()
        return _backward_loops(ctx, grad_out, q, k, v, out, lse, causal=causal, blocks=(block_q, block_k))


BUGGY.append(Attempt("10.3", "BackwardStackOnTheClass", BackwardStackOnTheClass, "kept_state",
                     ("ctx.save_for_backward", "first call's first")))


# ============================================================================ a setting of the whole process


@bug("9.1", "global_setting", "torch.get_default_dtype()", "float64")
def rope_tables_set_the_default_dtype(head_dim, max_tokens, theta=10000.0):
    """'Compute in float64': torch.set_default_dtype(torch.float64), never set back (r32)."""
    torch.set_default_dtype(torch.float64)
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2) / head_dim)
    angles = torch.arange(max_tokens)[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


@bug("1.3", "global_setting", "torch.is_grad_enabled()")
def attention_turns_gradients_off(q, k, v, mask=None):
    """'Attention needs no gradients to be checked': gradients off for the process."""
    torch.set_grad_enabled(False)
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v


@correct("1.3")
def attention_with_gradients_off_then_on_again(q, k, v, mask=None):
    """Turns gradients off and back on around nothing that needs them: the setting as it was found."""
    was = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    torch.set_grad_enabled(was)
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v


@correct("9.1")
def rope_tables_in_float64_by_their_own_default(head_dim, max_tokens, theta=10000.0):
    """Sets the default dtype for the tables and puts it back: nothing left changed."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2) / head_dim)
        angles = torch.arange(max_tokens)[:, None] * inv[None, :]
    finally:
        torch.set_default_dtype(previous)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()
