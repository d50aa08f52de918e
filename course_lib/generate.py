"""Sampling the next token, and generating text with or without a KV cache."""
from __future__ import annotations

import math
from numbers import Integral
from typing import Any

import torch
from torch import nn

from . import _validate as validate

__all__ = ["sample_next_token", "generate", "generate_with_cache", "generate_text"]


def sample_next_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                      top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row from logits (N, vocab) -> (N,) long.

    temperature 0 is greedy (argmax); below 1 sharpens the distribution, above 1 flattens it.
    top_k keeps the k most likely tokens; top_p keeps the smallest set whose probability
    reaches p (nucleus sampling).
    """
    validate.tensor("logits", logits, dim=2, floating=True)
    validate.number_in("temperature", temperature, low=0, high=math.inf, high_open=True, hint="0 = greedy")
    if top_k is not None:
        validate.positive_int("top_k", top_k)
    if top_p is not None:
        validate.number_in("top_p", top_p, low=0, high=1, low_open=True)
    _check_generator(generator)
    _check_samplable(logits)
    if temperature == 0:
        return logits.argmax(dim=-1)                                          # (N,)
    # Subtract each row's maximum first (softmax does not change): the best token's score is then exactly 0,
    # and 0 / temperature stays 0 however small the temperature, where x / 1e-40 overflows to inf and
    # inf - inf is NaN. A tiny temperature is then the greedy choice it tends to, not a crash.
    shifted = logits - logits.amax(dim=-1, keepdim=True)                      # (N, vocab), each row's best is 0
    logits = torch.where(shifted == 0, shifted, shifted / temperature)
    if top_k is not None and top_k < logits.shape[-1]:
        kth_best = logits.topk(top_k, dim=-1).values[:, -1:]                  # (N, 1)
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)           # (N, vocab)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the more likely ones before it already reach top_p;
        # the most likely token always stays
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)                    # back to vocab order
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)                                            # (N, vocab)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)       # (N,)


def _check_samplable(logits: torch.Tensor) -> None:
    """Refuse logits no token can be drawn from: no vocabulary, NaN, +inf, or a row that bans every token."""
    if logits.shape[-1] == 0:
        raise ValueError(f"logits: expected at least one token to choose from, got shape {tuple(logits.shape)}")
    bad = logits.isnan() | (logits == math.inf)
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"logits: expected finite scores (-inf bans a token), got {float(logits[row, col].detach())} "
                         f"at row {row}, token {col}; the model's output is broken (look for a NaN in its weights)")
    banned = (logits == -math.inf).all(dim=-1)
    if bool(banned.any()):
        row = int(banned.nonzero()[0])
        raise ValueError(f"logits: expected at least one token per row that is not -inf, got row {row} "
                         f"banning all {logits.shape[-1]} tokens")


def _check_generator(generator: Any) -> None:
    validate.instance("generator", generator, torch.Generator,
                      "a torch.Generator or None (torch.Generator().manual_seed(42) for repeatable samples)",
                      or_none=True)


def _check_prompt(idx: torch.Tensor) -> None:
    """A prompt idx (N, L), its ids checked already, with at least one token per row."""
    if idx.shape[1] == 0:
        raise ValueError("idx: expected at least one token per row to start from, got shape "
                         f"{tuple(idx.shape)}; use a newline or a start token as the prompt")


def _check_stop_token(stop_token: Any, vocab_size: int | None) -> int | None:
    """None, or one token id (an int, a numpy or 0-d tensor integer) in 0..vocab_size-1."""
    if stop_token is None:
        return None
    value = stop_token
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool and value.dim() == 0:
        value = int(value)
    span = f"0..{vocab_size - 1}" if vocab_size is not None else "0..vocab_size-1"
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0 \
            or (vocab_size is not None and value >= vocab_size):
        raise (TypeError if not isinstance(value, Integral) or isinstance(value, bool) else ValueError)(
            f"stop_token: expected None or a token id in {span}, got {validate.describe(stop_token)}")
    return int(value)


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _vocab_size(model: nn.Module) -> int | None:
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(size) if validate.is_int(size) and size > 0 else None


def _context_length(model: nn.Module) -> int:
    """The model's context length, config.max_tokens, or a message saying the model has none."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {validate.describe(model)}")
    size = getattr(getattr(model, "config", None), "max_tokens", None)
    if not validate.is_int(size) or size <= 0:
        raise TypeError(f"model: expected a model whose config.max_tokens gives its context length (a GPT or "
                        f"ModernGPT), got {type(model).__name__} with config.max_tokens={size!r}; generate() "
                        f"crops the text to that length")
    return int(size)


@torch.no_grad()
def _check_prompt_vocabulary(model: nn.Module, idx: torch.Tensor) -> None:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "vocab_size"):
        validate.in_vocabulary("idx", idx, config.vocab_size)


def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, stop_token: int | None = None,
             generator: torch.Generator | None = None, use_cache: bool = True) -> torch.Tensor:
    """Continue token ids idx (N, L) by up to max_new_tokens -> (N, L + new).

    A prompt longer than the context is cropped to its last ``max_tokens`` tokens. When the
    text outgrows the context, the model keeps the most recent ``max_tokens // 2`` tokens and
    carries on. Cached and uncached generation share this rule, so greedy decoding gives
    the same tokens both ways; the cache only saves recomputation.
    """
    validate.token_ids("idx", idx, dim=2)
    validate.non_negative_int("max_new_tokens", max_new_tokens)
    validate.boolean("use_cache", use_cache)
    _check_prompt_vocabulary(model, idx)
    _check_prompt(idx)
    max_tokens = _context_length(model)
    stop_token = _check_stop_token(stop_token, _vocab_size(model))
    _check_generator(generator)
    keep = max(1, max_tokens // 2)
    if use_cache and not hasattr(model, "new_cache"):
        raise TypeError(f"model: use_cache=True needs a model with new_cache(), got {type(model).__name__}")
    was_training = model.training
    model.eval()
    ids = idx.to(_model_device(model))
    start = max(0, ids.shape[1] - max_tokens)   # first position the model sees
    cache = None
    finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    try:
        for _ in range(max_new_tokens):
            if ids.shape[1] - start > max_tokens:
                start = ids.shape[1] - keep
                cache = None                         # positions shifted: the old keys are stale
            if not use_cache:
                logits = model(ids[:, start:])       # (N, window, vocab): everything again
            elif cache is None:
                cache = model.new_cache()
                logits = model(ids[:, start:], cache)
            else:
                logits = model(ids[:, -1:], cache)   # (N, 1, vocab): only the newest token
            next_id = sample_next_token(logits[:, -1].float(), temperature, top_k, top_p, generator)
            if stop_token is not None:
                next_id = next_id.masked_fill(finished, stop_token)
                finished |= next_id == stop_token
            ids = torch.cat([ids, next_id[:, None]], dim=1)   # (N, L + 1)
            if stop_token is not None and bool(finished.all()):
                break
    finally:
        model.train(was_training)
    return ids


@torch.no_grad()
def generate_with_cache(model: nn.Module, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy generation with a KV cache, within one context window (exercise 6.2's reference)."""
    validate.token_ids("idx", idx, dim=2)
    validate.non_negative_int("max_new_tokens", max_new_tokens)
    _check_prompt_vocabulary(model, idx)
    _check_prompt(idx)
    if idx.shape[1] + max_new_tokens - 1 > _context_length(model):
        raise ValueError(f"max_new_tokens: prompt ({idx.shape[1]}) + new tokens - 1 must fit in "
                         f"max_tokens={model.config.max_tokens}, got max_new_tokens={max_new_tokens}")
    if not hasattr(model, "new_cache"):
        raise TypeError(f"model: generate_with_cache needs a model with new_cache(), got {type(model).__name__}")
    cache = model.new_cache()
    logits = model(idx, cache)                                    # 1. the whole prompt once
    for step in range(max_new_tokens):
        next_id = logits[:, -1].argmax(dim=-1, keepdim=True)      # (N, 1)
        idx = torch.cat([idx, next_id], dim=1)                    # (N, L + 1)
        if step + 1 < max_new_tokens:
            logits = model(next_id, cache)                        # 2. only the new token
    return idx


def generate_text(model: nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int = 200,
                  **kwargs: Any) -> str:
    """Encode ``prompt``, generate, decode: text in, text out (prompt included)."""
    validate.instance("model", model, nn.Module, "a torch.nn.Module")   # as generate() says it
    # a str has an encode() of its own (str.encode("ab") looks for an encoding named "ab")
    validate.expect(not isinstance(tokenizer, (str, bytes)) and callable(getattr(tokenizer, "encode", None))
                    and callable(getattr(tokenizer, "decode", None)), "tokenizer",
                    "a tokenizer with encode() and decode() (a CharTokenizer or a transformers tokenizer)",
                    validate.describe(tokenizer), TypeError)
    if not isinstance(prompt, str):
        raise TypeError(f"prompt: expected a str, got {validate.describe(prompt)}")
    ids = list(tokenizer.encode(prompt)) if prompt else []
    if not ids:
        # An empty prompt still needs one token to condition on: start a new line.
        ids = list(tokenizer.encode("\n")) or [0]
    out = generate(model, torch.tensor([ids], dtype=torch.long), max_new_tokens, **kwargs)
    text = tokenizer.decode(out[0].tolist())
    return text if prompt else text[1:] if text.startswith("\n") else text
