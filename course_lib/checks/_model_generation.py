"""Checker for notebook 06: greedy generation with a KV cache."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from ._core import Failure, call, checker, expect_tensor, fail, register
from ._model_common import extend, randomize_, recording_calls

__all__ = ["check_kv_cache"]


def _model(max_tokens: int, embed_dim: int, seed: int) -> nn.Module:
    from course_lib.model import GPT, GPTConfig

    config = GPTConfig(vocab_size=17, max_tokens=max_tokens, embed_dim=embed_dim, num_heads=2, num_layers=2)
    torch.manual_seed(seed)
    # large random weights: clear winners at every step, so float noise never flips an argmax
    return randomize_(GPT(config), torch.Generator().manual_seed(seed)).eval()


@torch.no_grad()
def _without_offset(model: nn.Module, idx: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy decoding with a cache whose new tokens all sit at position 0 (the classic slip)."""
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(new):
        next_id = logits[:, -1].argmax(-1, keepdim=True)           # (N, 1)
        idx = torch.cat([idx, next_id], dim=1)
        x = model.token_embedding(next_id) + model.position_encoding(1, 0)
        for block, layer_cache in zip(model.blocks, cache):
            x = block(x, layer_cache)
        logits = model.head(model.ln_f(x))
    return idx


def _explain_calls(calls: list[dict[str, Any]]) -> str | None:
    """What the recorded model calls say about how the cache was used, if it was misused."""
    if not calls:
        return None   # model.forward(...) called directly bypasses the hook: nothing to say
    if all(c["cache"] is None for c in calls):
        return ("you never pass a cache to the model, so every step recomputes the whole sequence. Create one "
                "with model.new_cache() before the loop and pass it to every call.")
    later = calls[1:]
    if any(c["cache"] is None for c in later):
        return ("after the first call you call the model without the cache: the new token then sees no earlier "
                "token. Pass the same cache to every call.")
    if any(c["cache_length"] and c["shape"] and c["shape"][1] > 1 for c in later):
        return ("you feed the whole sequence again at every step into a cache that already holds it, so the cache "
                "stores the same tokens twice (and soon overflows). Once the prompt is in the cache, feed only "
                "the newest token.")
    fresh = [c for c in later if c["cache_length"] == 0]
    if fresh and all(c["shape"] and c["shape"][1] == 1 for c in fresh):
        return ("you start a new cache at every step, so each new token sees only itself. Create the cache once, "
                "before the loop, and keep passing it.")
    if fresh:
        return ("you create a new cache at every step and feed it the whole sequence, so nothing is saved. Create "
                "the cache once before the loop, then feed only the newest token.")
    return None


def _run(fn: Callable[..., Any], model: nn.Module, idx: torch.Tensor, new: int, what: str
         ) -> tuple[Any, list[dict[str, Any]]]:
    with recording_calls(model) as calls:
        try:
            with torch.no_grad():
                result = call(fn, model, idx.clone(), new, what=what)
        except Failure as failure:
            explanation = _explain_calls(calls) if failure.diagnosis == "exception" else None
            if explanation:
                fail("exception", extend(failure.message, f"It looks like {explanation}"))
            raise
    return result, calls


@checker("6.1")
def check_kv_cache(fn: Callable[..., Any]) -> str:
    """fn(model, idx (N, L), max_new_tokens) -> (N, L + new): greedy, with model.new_cache()."""
    from course_lib.generate import generate

    model = _model(max_tokens=16, embed_dim=16, seed=2)
    generator = torch.Generator().manual_seed(3)
    for batch, length, new in ((1, 1, 8), (2, 3, 6), (3, 7, 9), (2, 5, 1)):
        idx = torch.randint(0, model.config.vocab_size, (batch, length), generator=generator)
        what = f"generate_with_cache(model, idx of shape {tuple(idx.shape)}, max_new_tokens={new})"
        got, calls = _run(fn, model, idx, new, what)
        if isinstance(got, torch.Tensor) and got.dim() == 2 and got.shape[0] == batch:
            starts_with_prompt = got.shape[1] >= length and torch.equal(got[:, :length], idx)
            if got.shape[1] == new and not starts_with_prompt:
                fail("shape", f"{what} returned only the {new} new tokens; return the prompt followed by them, "
                              f"shape {(batch, length + new)}.")
            if got.shape[1] == length and starts_with_prompt:
                fail("shape", f"{what} returned the prompt unchanged: append each new token to idx "
                              f"(torch.cat along dim 1).")
            if got.shape[1] in (length + new - 1, length + new + 1):
                fail("shape", f"{what} returned {got.shape[1] - length} new tokens; generate exactly "
                              f"max_new_tokens = {new}.")
        expect_tensor(got, (batch, length + new), what, dtype=torch.long)
        expected = generate(model, idx, new, temperature=0, use_cache=False)
        if not torch.equal(got[:, :length], idx):
            fail("mismatch", f"{what}: the first {length} tokens of the result should be the prompt itself.")
        explanation = _explain_calls(calls)
        if not torch.equal(got, expected):
            if explanation:
                fail("mismatch", f"{what}: the tokens differ from generation without a cache; {explanation}")
            if torch.equal(got, _without_offset(model, idx, new)):
                fail("mismatch", f"{what}: the positions of the new tokens are not offset: each new token is "
                                 f"encoded at position 0. It sits at position cache length (the number of "
                                 f"tokens already in the cache).")
            step = int((got != expected).any(0).nonzero()[0]) - length
            fail("mismatch", f"{what}: the tokens differ from greedy generation without a cache from new token "
                             f"{step} on. Each step: argmax of the last position's logits, append it, feed only "
                             f"it to the model with the cache.")
        if explanation:
            fail("mismatch", f"{what}: the tokens are right, but {explanation}")
    return "Token for token the same as generation without a cache." + _speed_note(fn)


def _speed_note(fn: Callable[..., Any]) -> str:
    """Time the student's cached generation against the uncached reference (reported, never judged)."""
    from course_lib.generate import generate

    model = _model(max_tokens=64, embed_dim=64, seed=4)
    idx = torch.zeros(1, 1, dtype=torch.long)
    new = model.config.max_tokens - 1

    def timed(run: Callable[[int], Any], tokens: int) -> float:
        start = time.perf_counter()
        run(tokens)
        return time.perf_counter() - start

    try:
        with torch.no_grad():
            ours = lambda tokens: fn(model, idx, tokens)   # noqa: E731
            plain = lambda tokens: generate(model, idx, tokens, temperature=0, use_cache=False)   # noqa: E731
            timed(ours, 3), timed(plain, 3)   # warm-up: the first calls pay for allocations
            cached, uncached = timed(ours, new), timed(plain, new)
    except Exception:   # noqa: BLE001 - the speed is only reported, never judged
        return ""
    ratio = uncached / max(cached, 1e-9)
    verdict = (f"{ratio:.1f}x faster" if ratio >= 1.1 else f"{1 / ratio:.1f}x SLOWER: does each step recompute "
               f"the whole sequence, or copy the cache?" if ratio <= 1 / 1.1 else "about the same speed")
    return (f" Speed: {new} new tokens took {cached * 1000:.0f} ms with your cache and {uncached * 1000:.0f} ms "
            f"without ({verdict}). On a model this small the fixed cost of each call dominates; the saving grows "
            f"with the length and the model size.")


register("6.1", "generate_with_cache", [
    "One cache for the whole generation: cache = model.new_cache(), before the loop.",
    "Feed the prompt once with the cache; afterwards feed ONLY the newest token (shape (N, 1)) with the same cache: "
    "the model continues its positions after the cached ones.",
    "Each step: take the argmax of the last position's logits (keepdim), append it to idx, and feed it back.",
], solution="course_lib.generate:generate_with_cache")
