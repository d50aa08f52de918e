"""Round 32 (the stop's own class): a forward that changes its module's weights in place.

A forward may read its weights, never write them: weight decay or a renormalisation done inside forward, a clamp
that keeps a weight in a range, ``.data = ...``. Before, only 9.3 and 12.2 looked for it; the other module
exercises named the next call's mismatch, or passed when each case built a fresh module and called it once. Now
every call of a student's module is ``mutation``, the weight named. A module that records what it likes in a
buffer or an attribute stays right.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bank.attempts import new_bank
from bank.model_bugs import GivenBlock, GPTNoCache
from bank.modern_bugs import GQAWithMask
from bank.scale_bugs import _MaskedScaled, _MultiScaled
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

