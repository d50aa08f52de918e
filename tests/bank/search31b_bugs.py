"""Attempts of round 31's classes for 11.3 (ablate_head) and 12.2 (latent_attention).

11.3: a context manager that reseeds (or draws from) the caller's random state on entering or leaving the `with` is
named (the check's own RNG guard puts the state back afterwards, so only a comparison during the `with` shows it);
a keep-mask, a slice or a size kept from an earlier model (a global or a default argument keyed by the head alone,
or by (layer, head)) is named kept_state, not a raw size error or a wrong slice. Right beside them: an ablation
with a torch.Generator of its own, one that reseeds inside torch.random.fork_rng(), a mask made at every call, a
cache keyed by everything the mask depends on.

12.2: queries computed under no_grad (or detached) without a query latent are named gradient (the probe now runs
with and without q_lora_rank); queries
turned from position 0 while the keys are right are rope_positions, not the keys' kv_cache (the same outputs: the
cache tells them apart), while keys turned again in the cache stay kv_cache; a weight or a setting of the layer
changed in place is mutation; hidden scores of 0 (scores * mask, masked_fill 0) or a 0/1 mask added are
causal_mask. Right beside them: the mask built under no_grad, F.linear with the layer's weights, a scaled copy of
a weight, an additive float mask of -inf.
"""
from __future__ import annotations

import contextlib
import random

import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from course_lib import modern

BUGGY, CORRECT, bug, correct = new_bank()
_NEG = float("-inf")


# ============================================================================ 11.3: the caller's random state

def _zero_hook(cols):
    def hook(module, inputs):
        merged = inputs[0].clone()
        merged[..., cols] = 0.0
        return (merged,)
    return hook


def _cols(attn, head):
    return slice(head * attn.head_dim, (head + 1) * attn.head_dim)


@bug("11.3", "not_restored", "random state", "manual_seed", "on entering")
@contextlib.contextmanager
def ablate_seeds_the_rng(model, layer, head):
    """Seeds torch inside 'for reproducible ablations': the caller's RNG is reset."""
    torch.manual_seed(0)
    attn = model.blocks[layer].attn
    handle = attn.proj.register_forward_pre_hook(_zero_hook(_cols(attn, head)))
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "not_restored", "random state", "on leaving")
@contextlib.contextmanager
def ablate_reseeds_python_random_on_leaving(model, layer, head):
    """random.seed(0) in the finally 'to leave things tidy'."""
    attn = model.blocks[layer].attn
    handle = attn.proj.register_forward_pre_hook(_zero_hook(_cols(attn, head)))
    try:
        yield model
    finally:
        handle.remove()
        random.seed(0)


@bug("11.3", "not_restored", "random state", "generator")
@contextlib.contextmanager
def ablate_draws_a_random_tiebreak(model, layer, head):
    """Draws from the global RNG on entering (a random number it never needs)."""
    attn = model.blocks[layer].attn
    _ = torch.rand(1)
    handle = attn.proj.register_forward_pre_hook(_zero_hook(_cols(attn, head)))
    try:
        yield model
    finally:
        handle.remove()


@correct("11.3")
@contextlib.contextmanager
def ablate_with_a_generator_of_its_own(model, layer, head):
    """Draws from its own torch.Generator (a seeded one): the caller's random state is left alone."""
    generator = torch.Generator().manual_seed(0)
    torch.rand(3, generator=generator)
    attn = model.blocks[layer].attn
    handle = attn.proj.register_forward_pre_hook(_zero_hook(_cols(attn, head)))
    try:
        yield model
    finally:
        handle.remove()


@correct("11.3")
@contextlib.contextmanager
def ablate_reseeds_inside_fork_rng(model, layer, head):
    """Reseeds, but inside torch.random.fork_rng(), which puts the caller's state back before the yield."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.rand(2)
    attn = model.blocks[layer].attn
    handle = attn.proj.register_forward_pre_hook(_zero_hook(_cols(attn, head)))
    try:
        yield model
    finally:
        handle.remove()


# ============================================================================ 11.3: a mask kept from an earlier model

_MASKS_BY_HEAD: dict = {}


@bug("11.3", "kept_state", "earlier call", "afresh", "head alone")
@contextlib.contextmanager
def ablate_mask_cached_by_head(model, layer, head):
    """The keep-mask cached by head only: a model of another width reuses it (a size error in the hook)."""
    attn = model.blocks[layer].attn
    if head not in _MASKS_BY_HEAD:
        keep = torch.ones(attn.num_heads * attn.head_dim)
        keep[head * attn.head_dim:(head + 1) * attn.head_dim] = 0
        _MASKS_BY_HEAD[head] = keep

    def hook(module, inputs):
        return (inputs[0] * _MASKS_BY_HEAD[head].to(inputs[0].dtype),)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "kept_state", "earlier call", "afresh")
@contextlib.contextmanager
def ablate_slice_in_a_default_argument(model, layer, head, _slices={}):  # noqa: B006 - the slip itself
    """The column slice memoised in a mutable default keyed by head: the next model's head_dim differs, so it
    zeroes the wrong columns (no error, a wrong output)."""
    attn = model.blocks[layer].attn
    cols = _slices.setdefault(head, _cols(attn, head))
    handle = attn.proj.register_forward_pre_hook(_zero_hook(cols))
    try:
        yield model
    finally:
        handle.remove()


_MASKS_BY_LAYER_HEAD: dict = {}


@bug("11.3", "kept_state", "earlier call")
@contextlib.contextmanager
def ablate_mask_cached_by_layer_and_head(model, layer, head):
    """Keyed by (layer, head): still no model in the key, so another model's (1, 0) reuses the first's."""
    attn = model.blocks[layer].attn
    key = (layer, head)
    if key not in _MASKS_BY_LAYER_HEAD:
        keep = torch.ones(attn.num_heads * attn.head_dim)
        keep[head * attn.head_dim:(head + 1) * attn.head_dim] = 0
        _MASKS_BY_LAYER_HEAD[key] = keep

    def hook(module, inputs):
        return (inputs[0] * _MASKS_BY_LAYER_HEAD[key].to(inputs[0].dtype),)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@correct("11.3")
@contextlib.contextmanager
def ablate_mask_made_each_call(model, layer, head):
    attn = model.blocks[layer].attn
    width = attn.proj.in_features

    def hook(module, inputs):
        x = inputs[0]
        keep = torch.ones(width, dtype=x.dtype, device=x.device)
        keep[head * attn.head_dim:(head + 1) * attn.head_dim] = 0
        return (x * keep,)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


_MASKS_BY_EVERYTHING: dict = {}


@correct("11.3")
@contextlib.contextmanager
def ablate_mask_cached_by_everything_it_depends_on(model, layer, head):
    """A cache, keyed by the width, the head's size and the head: every model that can reuse it gets it right."""
    attn = model.blocks[layer].attn
    key = (attn.proj.in_features, attn.head_dim, head)
    if key not in _MASKS_BY_EVERYTHING:
        keep = torch.ones(attn.proj.in_features)
        keep[head * attn.head_dim:(head + 1) * attn.head_dim] = 0
        _MASKS_BY_EVERYTHING[key] = keep

    def hook(module, inputs):
        return (inputs[0] * _MASKS_BY_EVERYTHING[key].to(inputs[0]),)   # its dtype and device

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


# ============================================================================ 12.2 latent_attention

def _queries(layer, x, *, detach=False, functional=False):
    if layer.q_lora_rank is None:
        q = F.linear(x, layer.q_proj.weight, layer.q_proj.bias) if functional else layer.q_proj(x)
    else:
        q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    return q.detach() if detach else q


def _mla(layer, x, cache=None, *, q=None, fill="-inf", q_at_zero=False, keys_rotated_again=False,
         mask_no_grad=False, q_weight_scale=None):
    n, length, _ = x.shape
    start = 0 if cache is None else cache.length
    dn, dr, heads = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads
    if q is None:
        q = _queries(layer, x)
    if q_weight_scale is not None:   # a scaled copy of the weight, never the layer's own
        bias = layer.q_proj.bias
        q = F.linear(x, layer.q_proj.weight * q_weight_scale, None if bias is None else bias * q_weight_scale)
    q = q.view(n, length, heads, dn + dr).transpose(1, 2)
    q_nope, q_rope = q.split([dn, dr], dim=-1)
    q_rope = modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin) if q_at_zero else \
        modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], dim=-1)
    latent = layer.kv_a_layernorm(latent)
    if not keys_rotated_again:
        k_rope = modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    total = latent.shape[1]
    if keys_rotated_again:   # the whole cache turned at every call
        k_rope = modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    kv = layer.kv_b_proj(latent).view(n, total, heads, dn + layer.v_head_dim).transpose(1, 2)
    k_nope, v = kv.split([dn, layer.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_rope[:, None].expand(n, heads, total, dr)], dim=-1)
    scale = 1.0 if q_weight_scale is not None else layer.softmax_scale
    scores = torch.cat([q_nope, q_rope], dim=-1) @ k.transpose(-2, -1) * scale
    with torch.no_grad() if mask_no_grad else contextlib.nullcontext():
        keep = torch.ones(total, total, dtype=torch.bool, device=x.device).tril()[start:]
    if fill == "-inf":
        scores = scores.masked_fill(~keep, _NEG)
    elif fill == "multiply":
        scores = scores * keep.to(scores.dtype)
    elif fill == "zero":
        scores = scores.masked_fill(~keep, 0.0)
    elif fill == "add":
        scores = scores + keep.to(scores.dtype)
    elif fill == "additive_inf":
        scores = scores + torch.zeros(keep.shape, dtype=scores.dtype, device=x.device).masked_fill(~keep, _NEG)
    out = scores.softmax(-1) @ v
    return layer.o_proj(out.transpose(1, 2).reshape(n, length, heads * layer.v_head_dim))


# ---------------------------------------------------------------------------- gradient with and without a query latent

@bug("12.2", "gradient", "gradient", "q_lora_rank=None")
def latent_in_eval_of_the_rope_under_no_grad(layer, x, cache=None):
    """Computes the queries under no_grad 'they are not cached, so no gradient needed' (q_proj only: the query
    latent's path is left as it is)."""
    if layer.q_lora_rank is None:
        with torch.no_grad():
            q = layer.q_proj(x)
        return _mla(layer, x, cache, q=q)
    return _mla(layer, x, cache)


@bug("12.2", "gradient", "gradient")
def latent_queries_detached_without_a_query_latent(layer, x, cache=None):
    """q_proj(x).detach() 'the queries are only read': x and q_proj.weight lose their gradient."""
    return _mla(layer, x, cache, q=_queries(layer, x, detach=layer.q_lora_rank is None))


@correct("12.2")
def latent_mask_built_under_no_grad(layer, x, cache=None):
    """The bool mask built under torch.no_grad(): it has no gradient to cut."""
    return _mla(layer, x, cache, mask_no_grad=True)


@correct("12.2")
def latent_queries_through_functional_linear(layer, x, cache=None):
    return _mla(layer, x, cache, q=_queries(layer, x, functional=True))


# ---------------------------------------------------------------------------- queries or keys at the wrong positions

@bug("12.2", "rope_positions", "queries", "start + i", "offset=start", avoids=("turned again",))
def latent_queries_turned_from_zero(layer, x, cache=None):
    """Keys turned to start.., queries always to 0..: right without a cache, wrong with one."""
    return _mla(layer, x, cache, q_at_zero=True)


@bug("12.2", "rope_positions", "queries", "start + i", avoids=("turned again",))
def latent_queries_offset_forgotten(layer, x, cache=None):
    """apply_rotary(q_rope, cos, sin) without offset=, while k_rope gets offset=cache.length."""
    return _mla(layer, x, cache, q_at_zero=cache is not None)


@bug("12.2", "kv_cache", "turned again")
def latent_rotates_the_whole_cache_again(layer, x, cache=None):
    """Appends k_rope unturned and turns everything the cache returns at start: the same outputs as the queries
    from 0, but the cache holds unrotated keys (the keys' mistake, still named as such)."""
    return _mla(layer, x, cache, keys_rotated_again=True)


# ---------------------------------------------------------------------------- the layer changed in place

@bug("12.2", "mutation", "in place", "weight")
def latent_normalises_in_place_on_the_layer(layer, x, cache=None):
    """Folds softmax_scale into q_proj's weight once 'to save a multiply' (guarded by a flag on the layer)."""
    if not getattr(layer, "_folded", False):
        proj = layer.q_proj if layer.q_lora_rank is None else layer.q_b_proj
        with torch.no_grad():
            proj.weight.mul_(layer.softmax_scale)
        layer._folded = True
    scale, layer.softmax_scale = layer.softmax_scale, 1.0
    try:
        return _mla(layer, x, cache)
    finally:
        layer.softmax_scale = scale


@bug("12.2", "mutation", "softmax_scale")
def latent_folds_the_scale_and_sets_it_to_one(layer, x, cache=None):
    """Folds softmax_scale into the query weight once, and sets layer.softmax_scale = 1.0 for good: every call is
    right on this layer, but the layer is changed."""
    if layer.softmax_scale != 1.0:
        proj = layer.q_proj if layer.q_lora_rank is None else layer.q_b_proj
        with torch.no_grad():
            proj.weight.mul_(layer.softmax_scale)
        layer.softmax_scale = 1.0
    return _mla(layer, x, cache)


@bug("12.2", "mutation", "in place", "kv_a_layernorm")
def latent_clamps_the_norm_weight_in_place(layer, x, cache=None):
    """Clamps kv_a_layernorm's weight to >= 0 in place 'norm weights are positive': the layer is changed."""
    with torch.no_grad():
        layer.kv_a_layernorm.weight.clamp_(min=0.0)
    return _mla(layer, x, cache)


@correct("12.2")
def latent_scaled_copy_of_the_weight(layer, x, cache=None):
    """The scale folded into a COPY of q_proj's weight (layer.q_proj.weight * scale): the layer is untouched."""
    if layer.q_lora_rank is None:
        return _mla(layer, x, cache, q_weight_scale=layer.softmax_scale)
    return _mla(layer, x, cache)


# ---------------------------------------------------------------------------- hidden scores not -inf

@bug("12.2", "causal_mask", "-inf", "e^0")
def latent_mask_multiplied_in(layer, x, cache=None):
    """scores * mask: masked scores become 0, not -inf, so the future still gets weight."""
    return _mla(layer, x, cache, fill="multiply")


@bug("12.2", "causal_mask", "-inf", "e^0")
def latent_mask_filled_with_zero(layer, x, cache=None):
    """masked_fill(~mask, 0): 'zero out the future'."""
    return _mla(layer, x, cache, fill="zero")


@bug("12.2", "causal_mask", "-inf", "added")
def latent_bool_mask_added(layer, x, cache=None):
    """scores + mask: the bool mask added as 0/1, as if it were an additive mask."""
    return _mla(layer, x, cache, fill="add")


@correct("12.2")
def latent_additive_float_mask(layer, x, cache=None):
    """An additive float mask: 0 where a query may look, -inf elsewhere."""
    return _mla(layer, x, cache, fill="additive_inf")
