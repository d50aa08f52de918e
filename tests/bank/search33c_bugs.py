"""Round 33 (tester), part c: global settings under checks that call in no_grad, a recording buffer, slow loops."""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from course_lib.attention import MaskedAttention, causal_mask, merge_heads, split_heads
from course_lib.modern import GroupedQueryAttention, apply_rotary, repeat_kv

BUGGY, CORRECT, bug, correct = new_bank()
NEG = float("-inf")


@correct("2.2")
class MaskedRecordsWeightsAsAttribute(MaskedAttention):
    """The last weights kept as a plain attribute (not a buffer)."""
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)).masked_fill(~self.mask[:length, :length], NEG)
        self.last_weights = scores.softmax(-1).detach()
        return self.proj_dropout(self.proj(self.attn_dropout(scores.softmax(-1)) @ v))


@correct("9.6")
class GQAMaskCacheByDevice(GroupedQueryAttention):
    """Masks cached on the module in a dict keyed by (start, total, device); qk_norm and the window followed."""
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = split_heads(self.query(x), self.num_heads)
        k = split_heads(self.key(x), self.num_kv_heads)
        v = split_heads(self.value(x), self.num_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(k, self.rope_cos, self.rope_sin, offset=start)
        if cache is not None:
            k, v = cache.append(k, v)
        total = k.shape[2]
        masks = self.__dict__.setdefault("_masks", {})
        key = (start, total, x.device, self.sliding_window)
        if key not in masks:
            mask = causal_mask(total, device=x.device)[start:]
            if self.sliding_window is not None:
                i = torch.arange(start, total, device=x.device)[:, None]
                mask = mask & (i - torch.arange(total, device=x.device) < self.sliding_window)
            masks[key] = mask
        out = F.scaled_dot_product_attention(q, repeat_kv(k, self.groups), repeat_kv(v, self.groups),
                                             attn_mask=masks[key],
                                             dropout_p=self.dropout_rate if self.training else 0.0)
        return self.proj(merge_heads(out))


@correct("2.1")
def mask_double_loop(n):
    """A beginner's double loop, True where j <= i."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(i + 1):
            mask[i, j] = True
    return mask


@correct("9.1")
def rope_linspace_exact(head_dim, max_tokens, theta=10000.0):
    """linspace(0, T - 1, T): step exactly 1, the positions 0 .. T-1."""
    pos = torch.linspace(0, max_tokens - 1, max_tokens, dtype=torch.float64)
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = (pos[:, None] * freqs).repeat(1, 2)
    return angles.cos().float(), angles.sin().float()


@correct("9.1")
def rope_float_arange_step(head_dim, max_tokens, theta=10000.0):
    pos = torch.arange(0.0, max_tokens, 1.0)
    freqs = 1 / (theta ** (torch.arange(head_dim // 2) * 2 / head_dim))
    angles = pos[:, None] * freqs[None]
    return torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)


# ---- global settings left changed, under checks that may call in no_grad
@bug("5.4", "global_setting", "torch.is_grad_enabled()")
def sample_turns_grad_off(logits, temperature=1.0, top_k=None, generator=None):
    torch.set_grad_enabled(False)
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, NEG)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("2.1", "global_setting", "torch.get_default_dtype()")
def mask_sets_default_float64(n):
    torch.set_default_dtype(torch.float64)
    return torch.ones(n, n).tril().bool()


@bug("7.1", "global_setting", "torch.is_grad_enabled()")
def split_turns_grad_off(weight):
    torch.set_grad_enabled(False)
    return tuple(w.T for w in weight.chunk(3, dim=1))


@bug("4.1", "global_setting", "torch.get_default_dtype()")
def table_sets_default_float64(max_tokens, embed_dim):
    torch.set_default_dtype(torch.float64)
    pos = torch.arange(max_tokens)[:, None]
    angles = pos / 10000 ** (torch.arange(0, embed_dim, 2) / embed_dim)
    return torch.stack([angles.sin(), angles.cos()], -1).flatten(1).float()


@bug("11.3", "global_setting", "torch.get_default_dtype()")
@contextlib.contextmanager
def ablate_sets_default_dtype_for_good(model, layer, head):
    """Sets float64 as the default on entering and never puts it back."""
    torch.set_default_dtype(torch.float64)
    attn = model.blocks[layer].attn
    cols = slice(head * attn.head_dim, (head + 1) * attn.head_dim)

    def hook(module, inputs):
        x = inputs[0].clone()
        x[..., cols] = 0
        return (x,)
    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@bug("2.2", "global_setting", "torch.is_grad_enabled()")
class MaskedTurnsGradOffInForward(MaskedAttention):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)).masked_fill(~self.mask[:length, :length], NEG)
        out = self.proj_dropout(self.proj(self.attn_dropout(scores.softmax(-1)) @ v))
        torch.set_grad_enabled(False)     # "the rest is inference"
        return out


@bug("12.3", "global_setting", "torch.get_default_dtype()")
def linear_sets_default(q, k, v):
    torch.set_default_dtype(q.dtype if q.dtype != torch.float32 else torch.float64)
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])
    outs = []
    for i in range(q.shape[-2]):
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        outs.append((fq[..., i, None, :] @ s).squeeze(-2) / ((fq[..., i, :] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outs, -2)
