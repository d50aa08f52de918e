"""The course's attention inside transformers models, through transformers' AttentionInterface.

``course_attention_forward`` is the course's attention in the interface's form;
``register_course_attention`` plugs it into any model that uses the interface, and
``run_with_attention`` runs a model with any attention function (notebook 07, exercise 7.2).
"""
from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import _validate as validate
from ..attention import attention_weights

__all__ = ["course_attention_forward", "register_course_attention", "run_with_attention"]


def _as_bool_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """transformers' masks -> the course convention: bool, True = may attend."""
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if not attention_mask.is_floating_point():
        raise TypeError(f"attention_mask: expected a bool mask (True = may attend) or a float additive mask "
                        f"(0 = may attend, large negative = blocked), got dtype {attention_mask.dtype}")
    allowed = attention_mask == 0
    # Anything at or below -1e4 makes exp() underflow to exactly zero weight.
    if not bool((allowed | (attention_mask <= -1e4)).all()):
        odd = attention_mask[~allowed & (attention_mask > -1e4)].flatten()[0].item()
        raise ValueError(f"attention_mask: the course attention takes on/off masks (0 = may attend, a large "
                         f"negative number = blocked); got the additive bias {odd:g}. Position biases "
                         f"(ALiBi, relative positions) need attn_implementation='eager'")
    return allowed


def course_attention_forward(module: torch.nn.Module | None, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             scaling: float | None = None, dropout: float = 0.0,
                             **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' attention-interface function computed with the course's ``attention_weights``.

    query (N, heads, Lq, d), key/value (N, kv_heads, Lk, d); attention_mask bool or additive
    float, broadcastable to (N, heads, Lq, Lk), or None. Returns (output (N, Lq, heads, d),
    weights (N, heads, Lq, Lk)) — the shapes GPT2Attention and friends expect.
    """
    validate.tensor("query", query, dim=4, floating=True)
    validate.tensor("key", key, dim=4, floating=True)
    validate.tensor("value", value, dim=4, floating=True)
    n, heads, q_len, head_dim = query.shape
    if key.shape[0] != n or key.shape[-1] != head_dim or key.shape[:3] != value.shape[:3]:
        raise ValueError(f"key: expected (N={n}, kv_heads, Lk, {head_dim}) and value with the same "
                         f"(N, kv_heads, Lk), got key {tuple(key.shape)}, value {tuple(value.shape)}")
    for name, other in (("key", key), ("value", value)):   # each checked here, not in a matmul's error
        if other.dtype != query.dtype and not torch.is_autocast_enabled(query.device.type):   # autocast mixes them
            raise TypeError(f"{name}: expected dtype {query.dtype} (the dtype of query), got {other.dtype}; "
                            f"convert it with .to(query.dtype)")
        if other.device != query.device:
            raise ValueError(f"{name}: expected a tensor on {query.device} (the device of query), got {other.device}")
    if heads % key.shape[1]:
        raise ValueError(f"key: {key.shape[1]} key/value heads must divide the {heads} query heads, "
                         f"got key {tuple(key.shape)}")
    if scaling is not None:
        validate.positive_float("scaling", scaling)
    dropout = validate.probability("dropout", dropout)
    if key.shape[1] != heads:   # grouped-query attention: each key/value head serves several query heads
        key = key.repeat_interleave(heads // key.shape[1], dim=1)       # (N, heads, Lk, d)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)  # (N, heads, Lk, dv)
    k_len = key.shape[2]

    if attention_mask is None:
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        # transformers passes no mask when a plain causal mask would do (sdpa's is_causal
        # shortcut): the causality is then ours to apply, never to drop. The queries are the
        # last q_len positions (cached decoding: new tokens after the cached ones), so query i
        # sees keys 0..i + (k_len - q_len), as notebook 07 teaches.
        mask = (torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(diagonal=k_len - q_len)
                if is_causal and q_len > 1 else None)                  # (Lq, Lk)
    else:
        validate.tensor("attention_mask", attention_mask, min_dim=2)
        if attention_mask.shape[-1] != k_len or attention_mask.shape[-2] not in (1, q_len):
            raise ValueError(f"attention_mask: expected shape (..., {q_len}, {k_len}) (queries x keys), "
                             f"got {tuple(attention_mask.shape)}")
        mask = _as_bool_mask(attention_mask)                          # (N, 1, Lq, Lk)

    if scaling is not None and scaling != head_dim ** -0.5:
        # attention_weights scales by head_dim**-0.5; fold the rest of the requested scale into q
        query = query * (scaling * head_dim ** 0.5)
    if mask is None:
        weights = attention_weights(query, key)                       # (N, heads, Lq, Lk)
    else:
        # A query that may see no key at all (left padding) would get 0/0 = NaN from the
        # softmax, and the NaN would leak into every position through the values of the
        # next layer. Give such rows zero weight, hence a zero output, instead.
        sees_something = mask.any(dim=-1, keepdim=True)               # (..., Lq, 1)
        weights = attention_weights(query, key, mask | ~sees_something) * sees_something
    if dropout > 0:   # as eager attention: GPT-2 already passes 0.0 in eval mode
        weights = F.dropout(weights, p=dropout, training=getattr(module, "training", True))
    output = weights @ value                                          # (N, heads, Lq, dv)
    return output.transpose(1, 2).contiguous(), weights              # (N, Lq, heads, dv)


_BUILT_IN = {"eager", "sdpa", "flex_attention", "paged|eager", "flash_attention_2", "flash_attention_3",
             "flash_attention_4"}


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or "/" in name or name in _BUILT_IN:
        raise ValueError(f"name: expected a new attention implementation name (no '/', not one of "
                         f"{sorted(_BUILT_IN)}), got {validate.describe(name)}")
    return name


def register_course_attention(name: str = "course", fn: Callable[..., Any] = course_attention_forward) -> str:
    """Register ``fn`` with transformers under ``name``; select it with attn_implementation=name.

    The mask function is registered too: for a name the mask registry does not
    know, transformers builds no mask at all — padding would be silently ignored.
    The registered masks are sdpa's: bool, True = may attend, or None when a plain
    causal mask would do (``course_attention_forward`` then applies causality itself).
    """
    _check_name(name)
    if not callable(fn):
        raise TypeError(f"fn: expected an attention function (module, query, key, value, attention_mask, "
                        f"scaling=None, dropout=0.0, **kwargs), got {validate.describe(fn)}")
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def _unregister(name: str) -> None:
    # The registries have register() but no unregister(): drop the global entries directly.
    AttentionInterface._global_mapping.pop(name, None)
    AttentionMaskInterface._global_mapping.pop(name, None)


def _checked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a student's attention function so a wrong return names what was wrong."""
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        result = fn(module, query, key, value, attention_mask, *args, **kwargs)
        if not isinstance(result, (tuple, list)) or len(result) != 2:   # transformers only unpacks the pair
            raise TypeError(f"fn: expected a tuple (attn_output, attn_weights or None), got {validate.describe(result)}")
        result = tuple(result)
        output = result[0]
        n, heads, q_len, _ = query.shape
        expected = (n, q_len, heads, value.shape[-1])
        if not isinstance(output, torch.Tensor) or tuple(output.shape) != expected:
            hint = ("; transpose(1, 2) the (N, heads, L, head_dim) result"
                    if isinstance(output, torch.Tensor) and tuple(output.shape) == (n, heads, q_len, value.shape[-1])
                    else "")
            raise ValueError(f"fn: expected attn_output of shape (N, L, heads, head_dim) = {expected}, "
                             f"got {validate.describe(output)}{hint}")
        return result
    return attention


@contextlib.contextmanager
def _attention_implementation(hf_model: Any, fn: Callable[..., Any]) -> Iterator[str]:
    name = register_course_attention(f"course_tmp_{uuid.uuid4().hex[:8]}", _checked(fn))
    previous = hf_model.config._attn_implementation
    try:
        hf_model.set_attn_implementation(name)
        yield name
    finally:
        hf_model.set_attn_implementation(previous)
        _unregister(name)


def run_with_attention(hf_model: transformers.PreTrainedModel, fn: Callable[..., Any], input_ids: torch.Tensor,
                       attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (N, L, vocab) of ``hf_model`` with every attention layer computed by ``fn``.

    ``fn`` has the signature of :func:`course_attention_forward`. It is registered
    under a temporary name for this call only; the model's own implementation is
    restored afterwards, even when ``fn`` fails.
    """
    if not isinstance(hf_model, transformers.PreTrainedModel):
        raise TypeError(f"hf_model: expected a transformers model (e.g. GPT2LMHeadModel), "
                        f"got {validate.describe(hf_model)}")
    if not callable(fn):
        raise TypeError(f"fn: expected an attention function (module, query, key, value, attention_mask, "
                        f"scaling=None, dropout=0.0, **kwargs), got {validate.describe(fn)}")
    validate.token_ids("input_ids", input_ids, dim=2)
    if attention_mask is not None:
        validate.tensor("attention_mask", attention_mask, dim=2)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask: expected the shape of input_ids {tuple(input_ids.shape)} "
                             f"(1 = token, 0 = padding), got {tuple(attention_mask.shape)}")
    with _attention_implementation(hf_model, fn), torch.no_grad():
        return hf_model(input_ids=input_ids, attention_mask=attention_mask).logits
