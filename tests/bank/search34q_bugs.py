"""Round 34q (the tester's round 34b, notebooks 09 and 11): slips the checks let through or did not name.

11.3: both models of the check had heads embed_dim / heads wide and as many key/value heads as query heads, so a
head's width taken from the embedding (proj.out_features // num_heads) passed, and so did zeroing the head's
columns of the value projection (the same zeros in plain multi-head attention). The check now also runs notebook
09's ModernGPT with heads of 6 (embed_dim 16, 4 heads) sharing 2 key/value heads: ``ablation_slice`` names the
width, ``ablation_method`` the shared value head.

Named now instead of ``mismatch`` (or ``exception``): 9.1 positions counted down (``rope_positions``); 9.2 and
9.5 the first sequence's result copied over the batch (``batch_mixing``, each sequence alone is right); 9.6 a
position counter kept on the module instead of cache.length, which runs past the tables on a later generation
(``kept_state``); 11.2 the diagonal's last `half` entries, which reach into the first half when the second half
is shorter (``score_positions``).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from course_lib.attention import causal_mask, merge_heads, split_heads
from course_lib.modern import apply_rotary, repeat_kv, rope_tables, rotate_half

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 9.1 rope_tables

def _tables(positions, head_dim, theta):
    freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(positions, freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


@bug("9.1", "rope_positions", "count DOWN")
def rope_positions_reversed(head_dim, max_tokens, theta=10000.0):
    """Wrong (the tester's): positions counted down, row m at position max_tokens - 1 - m."""
    return _tables(torch.arange(max_tokens - 1, -1, -1, dtype=torch.float64), head_dim, theta)


@bug("9.1", "rope_positions", "count DOWN")
def rope_positions_flipped_rows(head_dim, max_tokens, theta=10000.0):
    """Wrong: the right tables with their rows flipped (.flip(0)), as if the newest token came first."""
    cos, sin = _tables(torch.arange(max_tokens, dtype=torch.float64), head_dim, theta)
    return cos.flip(0), sin.flip(0)


@bug("9.1", "rope_positions", "count DOWN")
def rope_positions_from_max_tokens_down(head_dim, max_tokens, theta=10000.0):
    """Wrong: positions max_tokens .. 1, counted down from the context's length."""
    return _tables(torch.arange(max_tokens, 0, -1, dtype=torch.float64), head_dim, theta)


@correct("9.1")
def rope_positions_flipped_twice(head_dim, max_tokens, theta=10000.0):
    """Right: the positions counted down, then flipped back: 0 .. max_tokens - 1."""
    return _tables(torch.arange(max_tokens - 1, -1, -1, dtype=torch.float64).flip(0), head_dim, theta)


# ============================================================================ 9.2 apply_rotary

@bug("9.2", "batch_mixing", "FIRST sequence", "x[0]")
def rotary_first_sequence_broadcast(x, cos, sin, offset=0):
    """Wrong (the tester's): turns x[0] only and expands it over the batch: right for N = 1 only."""
    length = x.shape[-2]
    c, s = cos[offset:offset + length].to(x.dtype), sin[offset:offset + length].to(x.dtype)
    first = x[0] * c + rotate_half(x[0]) * s
    return first.unsqueeze(0).expand_as(x)


@bug("9.2", "batch_mixing", "FIRST sequence")
def rotary_first_sequence_expanded(x, cos, sin, offset=0):
    """Wrong: x[:1] turned and broadcast against zeros of x's shape: every sequence gets sequence 0's result."""
    length = x.shape[-2]
    c, s = cos[offset:offset + length].to(x.dtype), sin[offset:offset + length].to(x.dtype)
    head = x[:1]
    return torch.zeros_like(x) + (head * c + rotate_half(head) * s)


@correct("9.2")
def rotary_per_sequence_loop(x, cos, sin, offset=0):
    """Right: one sequence at a time, stacked back into the batch."""
    length = x.shape[-2]
    c, s = cos[offset:offset + length].to(x.dtype), sin[offset:offset + length].to(x.dtype)
    return torch.stack([seq * c + rotate_half(seq) * s for seq in x.unbind(0)])


# ============================================================================ 9.5 repeat_kv

@bug("9.5", "batch_mixing", "FIRST sequence")
def repeat_kv_first_sequence(x, groups):
    """Wrong (the tester's): repeats x[0] and broadcasts it: right for a batch of one only."""
    return x[0].repeat_interleave(groups, dim=0)[None].expand(x.shape[0], -1, -1, -1)


@bug("9.5", "batch_mixing", "FIRST sequence")
def repeat_kv_first_sequence_expanded(x, groups):
    """Wrong: x[:1] expanded on a group axis, then over the batch with .expand(N, ...)."""
    n, kv, length, d = x.shape
    one = x[:1, :, None].expand(1, kv, groups, length, d).reshape(1, kv * groups, length, d)
    return one.expand(n, -1, -1, -1).contiguous()


@correct("9.5")
def repeat_kv_per_sequence_loop(x, groups):
    """Right: each sequence's heads repeated on their own, stacked back."""
    return torch.stack([seq.repeat_interleave(groups, dim=0) for seq in x.unbind(0)])


# ============================================================================ 9.6 GroupedQueryAttention

class NotebookGQA(torch.nn.Module):
    """The constructor the notebook gives (no qk_norm, sliding_window or head_dim options)."""

    def __init__(self, embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta=10000.0):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.groups = num_heads // num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.max_tokens = max_tokens
        self.query = torch.nn.Linear(embed_dim, num_heads * self.head_dim, bias=False)
        self.key = torch.nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.value = torch.nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.proj = torch.nn.Linear(num_heads * self.head_dim, embed_dim, bias=False)
        cos, sin = rope_tables(self.head_dim, max_tokens, rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def attend(self, x, cache, start):
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        mask = causal_mask(k.shape[-2], device=x.device)[k.shape[-2] - x.shape[1]:]
        out = F.scaled_dot_product_attention(q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), attn_mask=mask)
        return self.proj(merge_heads(out))


@correct("9.6")
class GQAStartFromCacheEachCall(NotebookGQA):
    """Right: the start read from the cache it is given, at every call."""
    def forward(self, x, cache=None):
        return self.attend(x, cache, 0 if cache is None else cache.length)


@bug("9.6", "kept_state", "self._pos", "fresh")
class GQACountsPositionsItself(NotebookGQA):
    """Wrong (the tester's): its own position counter (self._pos) instead of cache.length: a second generation
    with a fresh cache starts where the first one stopped, past the tables."""
    def forward(self, x, cache=None):
        if cache is None:
            start = 0
        else:
            start = getattr(self, "_pos", 0)
            self._pos = start + x.shape[1]
        return self.attend(x, cache, start)


# Keyed by the module itself, not id(self): a freed module's id is given to later ones, so a dict keyed by id
# would hand an earlier test's count to a fresh module and make this attempt's verdict depend on memory reuse.
_TOKENS_SEEN = weakref.WeakKeyDictionary()


@bug("9.6", "kept_state", "cache.length", "fresh")
class GQAPositionCounterInGlobal(NotebookGQA):
    """Wrong: the tokens seen counted in a module-level dict keyed by the module: the same slip outside self."""
    def forward(self, x, cache=None):
        start = _TOKENS_SEEN.get(self, 0) if cache is not None else 0
        if cache is not None:
            _TOKENS_SEEN[self] = start + x.shape[1]
        return self.attend(x, cache, start)


# ============================================================================ 11.2 induction_score

@bug("11.2", "score_positions", "LAST `half` entries", "FIRST half")
def induction_last_half_entries(weights, half):
    """Wrong (the tester's): the LAST `half` entries of the offset diagonal: right when L = 2 * half, but a repeat
    cut short brings in queries of the first half."""
    return weights.diagonal(offset=1 - half, dim1=-2, dim2=-1)[..., -half:].mean(dim=(0, 2))


@bug("11.2", "score_positions", "LAST `half` entries")
def induction_last_half_rows(weights, half):
    """Wrong: the last `half` query rows, each at its key i - half + 1, gathered with index tensors."""
    length = weights.shape[-1]
    rows = torch.arange(length - half, length, device=weights.device)
    return weights[..., rows, rows - half + 1].mean(dim=(0, 2))


@correct("11.2")
def induction_second_half_by_length(weights, half):
    """Right: the diagonal's last L - half entries, which are the queries half .. L-1 whatever L is."""
    length = weights.shape[-1]
    return weights.diagonal(offset=1 - half, dim1=-2, dim2=-1)[..., -(length - half):].mean(dim=(0, 2))


# ============================================================================ 11.3 ablate_head

def _zero_proj_input(model, layer, cols):
    """A pre-hook on proj zeroing ``cols`` of its input, removed on leaving."""
    attn = model.blocks[layer].attn

    def hook(module, inputs):
        x = inputs[0].clone()
        x[..., cols] = 0
        return (x, *inputs[1:])
    return attn.proj.register_forward_pre_hook(hook)


@bug("11.3", "ablation_slice", "head_dim", "embed_dim // num_heads")
@contextlib.contextmanager
def ablate_head_dim_from_the_embedding(model, layer, head):
    """Wrong (the tester's): head_dim as proj.out_features // num_heads (embed_dim / heads): wrong when heads *
    head_dim != embed_dim."""
    attn = model.blocks[layer].attn
    size = attn.proj.out_features // attn.num_heads
    handle = _zero_proj_input(model, layer, slice(head * size, (head + 1) * size))
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "ablation_slice", "head_dim", "embed_dim // num_heads")
@contextlib.contextmanager
def ablate_width_from_the_embedding(model, layer, head):
    """Wrong: proj's weight columns zeroed (and restored), the width taken from the query's input, embed_dim."""
    attn = model.blocks[layer].attn
    size = attn.query.in_features // attn.num_heads
    saved = attn.proj.weight.detach().clone()
    with torch.no_grad():
        attn.proj.weight[:, head * size:(head + 1) * size] = 0
    try:
        yield model
    finally:
        with torch.no_grad():
            attn.proj.weight.copy_(saved)


@bug("11.3", "ablation_method", "value projection", "every query head of its")
@contextlib.contextmanager
def ablate_hook_on_the_value_projection(model, layer, head):
    """Wrong (the tester's): zeroes the head's columns of attn.value's OUTPUT: the right zeros in multi-head
    attention, but a grouped value head feeds several query heads."""
    attn = model.blocks[layer].attn
    cols = slice(head * attn.head_dim, (head + 1) * attn.head_dim)

    def hook(module, inputs, output):
        output = output.clone()
        output[..., cols] = 0
        return output
    handle = attn.value.register_forward_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "ablation_method", "head // groups", "every query head of its")
@contextlib.contextmanager
def ablate_value_rows_of_the_group(model, layer, head):
    """Wrong: zeroes the value weights (and bias) of the head's key/value head, head // groups: its whole group
    goes silent."""
    attn = model.blocks[layer].attn
    groups = attn.num_heads // getattr(attn, "num_kv_heads", attn.num_heads)
    rows = slice((head // groups) * attn.head_dim, (head // groups + 1) * attn.head_dim)
    saved = {name: p.detach().clone() for name, p in attn.value.named_parameters()}
    with torch.no_grad():
        for p in attn.value.parameters():
            p[rows] = 0
    try:
        yield model
    finally:
        with torch.no_grad():
            for name, p in attn.value.named_parameters():
                p.copy_(saved[name])


@correct("11.3")
@contextlib.contextmanager
def ablate_width_from_proj_in_features(model, layer, head):
    """Right: the head's width as proj.in_features // num_heads (the merged heads' width)."""
    attn = model.blocks[layer].attn
    size = attn.proj.in_features // attn.num_heads
    handle = _zero_proj_input(model, layer, slice(head * size, (head + 1) * size))
    try:
        yield model
    finally:
        handle.remove()


@correct("11.3")
@contextlib.contextmanager
def ablate_view_heads_from_proj_input(model, layer, head):
    """Right: proj's input viewed as (N, L, heads, -1), the head's slot multiplied by a keep-mask."""
    attn = model.blocks[layer].attn

    def hook(module, inputs):
        x = inputs[0]
        keep = torch.ones(attn.num_heads, 1, dtype=x.dtype, device=x.device)
        keep[head] = 0
        return ((x.unflatten(-1, (attn.num_heads, -1)) * keep).flatten(-2), *inputs[1:])
    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()
