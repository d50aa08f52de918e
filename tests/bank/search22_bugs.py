"""Student attempts that the twenty-second scripted search of the checks found misjudged (2026-11-30), one per class.

Before, each was passed while wrong (a detour through a lower precision that whole-number inputs survive, an index
made on the CPU that only index_select's and gather's meta kernels let through, N recounted from the
configuration), refused while right (1.1's predictions as a generator, a dict's values or numpy's 0-d arrays,
5.1's pair stacked in one tensor, 4.1's float32 positions beside default-dtype frequencies in a float64
notebook), or told a mistake it does not make ("it keeps something from an earlier call" for a rounding).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from bank.attempts import Attempt, new_bank
from bank.search_bugs import _GivenGQA
from course_lib.attention import MaskedAttention, causal_mask, merge_heads, split_heads
from course_lib.model import GPT
from course_lib.modern import apply_rotary, repeat_kv, rotate_half

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 1.1: predictions in any ordered form

CORRECT.append(Attempt("1.1", "prediction_as_dict_values",
                       ({"k0": 0.21194, "k1": 0.57612, "k2": 0.21194}.values(), 2.0), None))
CORRECT.append(Attempt("1.1", "prediction_as_numpy_scalars",
                       ([np.float64(0.21194), np.array(0.57612), np.float32(0.21194)], 2.0), None))
CORRECT.append(Attempt("1.1", "prediction_as_a_row_of_a_batch", (torch.tensor([[[0.2119, 0.5761, 0.2119]]]), 2.0), None))


# ============================================================================ 3.1, 3.2: only rearrange, on x's device

@bug("3.1", "precision", "rounded", ".half()")
def split_through_half(x, num_heads):
    n, length, e = x.shape
    return x.half().view(n, length, num_heads, e // num_heads).transpose(1, 2).to(x.dtype)


@bug("3.1", "precision", "lower precision")
def split_through_float32(x, num_heads):   # float64 inputs come back float64, their digits past float32 lost
    n, length, e = x.shape
    return x.float().view(n, length, num_heads, e // num_heads).transpose(1, 2).to(x.dtype)


@bug("3.2", "precision", "whole numbers", avoids=("keeps something",))
def merge_rounded(x):
    n, h, length, d = x.shape
    return x.transpose(1, 2).reshape(n, length, h * d).round()


@bug("3.1", "device", "created on the cpu")
def split_with_a_cpu_index(x, num_heads):   # index_select needs its index on x's device (CUDA raises)
    n, length, e = x.shape
    return x.index_select(-1, torch.arange(e)).view(n, length, num_heads, e // num_heads).transpose(1, 2)


@bug("3.2", "device", "created on the cpu")
def merge_with_a_cpu_gather(x):
    n, h, length, d = x.shape
    merged = x.transpose(1, 2).reshape(n, length, h * d)
    return merged.gather(-1, torch.arange(h * d).expand(n, length, h * d))


# ============================================================================ 2.2: a softmax in half precision

@bug("2.2", "precision", "half precision", avoids=("merging the heads",))
class MaskedSoftmaxInHalf(MaskedAttention):
    def forward(self, x):
        length = x.shape[1]
        scores = (self.query(x) @ self.key(x).mT / self.embed_dim ** 0.5).masked_fill(
            ~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(scores.half().softmax(-1).to(x.dtype))
        return self.proj_dropout(self.proj(weights @ self.value(x)))


# ============================================================================ 4.1: no input to take a dtype from

@correct("4.1")
def table_float32_positions_default_frequencies(max_tokens, embed_dim):
    position = torch.arange(max_tokens, dtype=torch.float32)[:, None]                        # (T, 1), as the hint
    frequency = torch.exp(torch.arange(0, embed_dim, 2) * (-math.log(10000.0) / embed_dim))  # the default dtype
    angles = position @ frequency[None, :].float()                                           # (T, d/2)
    table = torch.zeros(max_tokens, embed_dim)
    table[:, 0::2], table[:, 1::2] = angles.sin(), angles.cos()
    return table


@correct("4.1")
def table_mixed_dtypes_in_mm(max_tokens, embed_dim):   # float32 @ default dtype: fails in a float64 notebook only
    position = torch.arange(max_tokens, dtype=torch.float32)[:, None]
    frequency = 10000.0 ** (-torch.arange(0, embed_dim, 2) / embed_dim)
    angles = torch.mm(position, frequency[None, :])
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)


@bug("4.1", "precision", "half-precision", avoids=(".float()",))
def table_in_bfloat16(max_tokens, embed_dim):
    position = torch.arange(max_tokens, dtype=torch.float32)[:, None]
    frequency = 10000.0 ** (-torch.arange(0, embed_dim, 2, dtype=torch.float32) / embed_dim)
    table = torch.zeros(max_tokens, embed_dim, dtype=torch.bfloat16)
    table[:, 0::2], table[:, 1::2] = torch.sin(position * frequency), torch.cos(position * frequency)
    return table


# ============================================================================ 5.1, 6.1

@bug("5.1", "dtype", "long")   # refiled: the windows are torch.long whatever the ids' dtype (round 34)
def windows_stacked_in_one_tensor(ids, max_tokens):
    chunks = ids.unfold(0, max_tokens + 1, max_tokens)
    return torch.stack([chunks[:, :-1], chunks[:, 1:]])   # (2, W, T): `inputs, targets = ...` unpacks it


@bug("6.1", "weights_count", "num_weights argument")
def flops_recounting_the_weights(config, num_weights):   # N from the configuration, not the argument
    n = GPT(config).num_parameters(include_embeddings=False)
    return 6 * n + 12 * config.num_layers * config.num_heads * config.head_dim * config.max_tokens





# ============================================================================ the twenty-third search, of these fixes

@bug("3.1", "precision", "whole numbers", ".round()")
def split_rounded(x, num_heads):
    n, length, e = x.shape
    return x.view(n, length, num_heads, e // num_heads).transpose(1, 2).round()


@bug("3.1", "precision", "integer dtype")
def split_through_long(x, num_heads):
    n, length, e = x.shape
    return x.long().to(x.dtype).view(n, length, num_heads, e // num_heads).transpose(1, 2)


_SPLITS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


@bug("3.1", "kept_state", "earlier call")
def split_cached_on_id(x, num_heads):   # the same tensor, changed in place by an optimizer step, is not seen anew
    if id(x) not in _SPLITS:
        n, length, e = x.shape
        _SPLITS[id(x)] = (x, x.view(n, length, num_heads, e // num_heads).transpose(1, 2).clone())
    return _SPLITS[id(x)][1]


@bug("9.2", "device", "created on the cpu")
def rope_cpu_positions_only_past_zero(x, cos, sin, offset=0):   # the cached path alone builds a CPU index
    length = x.shape[-2]
    if offset == 0:
        c, s = cos[:length], sin[:length]
    else:
        positions = torch.arange(offset, offset + length)
        c, s = cos.index_select(0, positions), sin.index_select(0, positions)
    return x * c.to(x.dtype) + rotate_half(x) * s.to(x.dtype)


@bug("9.2", "device", "created on the cpu")
def rope_sign_written_from_the_cpu(x, cos, sin, offset=0):   # index_put_ with CPU values (not the indices)
    length, d = x.shape[-2:]
    sign = torch.ones(d, dtype=x.dtype, device=x.device)
    sign[torch.arange(d // 2, device=x.device)] = -torch.ones(d // 2, dtype=x.dtype)
    turned = torch.roll(x, d // 2, dims=-1) * sign
    return x * cos[offset:offset + length].to(x.dtype) + turned * sin[offset:offset + length].to(x.dtype)


@bug("9.6", "device", "kv cache")
class GQAMaskOnTheCpuOnlyWithACache(_GivenGQA):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is None:
            out = F.scaled_dot_product_attention(q, repeat_kv(k, self.groups), repeat_kv(v, self.groups),
                                                 is_causal=True)
        else:
            k, v = cache.append(k, v)
            mask = causal_mask(start + x.shape[1])[start:]   # made on the CPU: a GPU refuses it
            out = F.scaled_dot_product_attention(q, repeat_kv(k, self.groups), repeat_kv(v, self.groups),
                                                 attn_mask=mask)
        return self.proj(merge_heads(out))


@bug("5.1", "dtype", "long")   # refiled: the windows are torch.long whatever the ids' dtype (round 34)
def windows_stacked_by_numpy(ids, max_tokens):
    chunks = ids.unfold(0, max_tokens + 1, max_tokens).numpy()
    return np.stack([chunks[:, :-1], chunks[:, 1:]])


# ============================================================================ the twenty-fourth search, across exercises

@bug("9.5", "precision", "lower precision")
def repeat_kv_through_half(x, groups):   # copies of x's heads, each rounded to float16 on the way
    return x.half().to(x.dtype).repeat_interleave(groups, dim=1)


@bug("9.5", "precision", "whole numbers")
def repeat_kv_rounded(x, groups):
    return x.round().repeat_interleave(groups, dim=1)


@bug("5.2", "precision", "lower precision", avoids=("keeps something",))
def loss_of_bfloat16_logits(logits, targets):   # rounded logits: off by a rounding's size, nothing kept
    return F.cross_entropy(logits.bfloat16().to(logits.dtype).flatten(0, 1), targets.flatten())


class _GQAWithMask(_GivenGQA):
    """Notebook 09's layer with the mask left to ``mask(start, total, x)``: the slips below differ only there."""

    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        mask = self.mask(start, start + x.shape[1], x)
        out = F.scaled_dot_product_attention(q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), attn_mask=mask)
        return self.proj(merge_heads(out))


@bug("9.6", "device", "created on the cpu")
class GQAMaskOnTheCpuForLongInputs(_GQAWithMask):
    def mask(self, start, total, x):
        rows = causal_mask(total)[start:total]
        return rows if total > 6 else rows.to(x.device)   # made on the CPU once the sequence is long


@bug("9.6", "device", "training mode")
class GQAMaskOnTheCpuInTraining(_GQAWithMask):
    def mask(self, start, total, x):
        rows = causal_mask(total)[start:total]
        return rows if self.training else rows.to(x.device)
