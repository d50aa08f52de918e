"""Checker for notebook 05's sampler: statistics of many draws with fixed seeds."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ._core import Failure, call, checker, expect_tensor, fail, register
from ._model_common import as_tensor, extend

__all__ = ["check_sampling"]

# two different rows, so that a batch mixes distributions; no ties anywhere
_BASE = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0],
                      [-1.0, 0.0, 2.5, 0.5, 1.0, -0.5]])
_REPEATS = 2500     # draws per row: a frequency's standard deviation is at most 0.01
_TOLERANCE = 0.045  # 4.5 standard deviations: a correct sampler fails by chance about once in 2000 checks


def _draw(fn: Callable[..., Any], logits: torch.Tensor, what: str, **kwargs: Any) -> torch.Tensor:
    try:
        result = as_tensor(call(fn, logits.clone(), what=what, **kwargs))
    except Failure as failure:
        text = failure.message
        if failure.diagnosis != "exception":
            raise
        if kwargs.get("temperature") == 0:
            fail("exception", extend(text, "With temperature=0 the sampler is greedy: return the argmax before "
                                           "dividing by the temperature."))
        if "probability tensor contains" in text or "invalid multinomial distribution" in text:
            fail("normalization", extend(text, "torch.multinomial needs non-negative weights, one distribution "
                                               "per row: turn the logits into probabilities with a softmax over "
                                               "the vocabulary (the last dimension) first."))
        raise
    if isinstance(result, torch.Tensor) and result.shape == (logits.shape[0], 1):
        fail("shape", f"{what} returned shape {tuple(result.shape)}; expected ({logits.shape[0]},), one token id "
                      f"per row. torch.multinomial(..., 1) keeps a last dimension of size 1: squeeze it.")
    if isinstance(result, torch.Tensor) and result.dim() == 0 and logits.shape[0] == 1:
        fail("shape", f"{what} returned a single number of shape (); expected (1,), one token id per row even "
                      f"for a batch of one. `.squeeze()` drops every axis of size 1, the batch too: use "
                      f".squeeze(-1) (or [:, 0]).")
    expect_tensor(result, (logits.shape[0],), what)
    if result.is_floating_point() or result.dtype == torch.bool:
        fail("dtype", f"{what} returned dtype {result.dtype}; token ids are integers (torch.long).")
    if result.dtype != torch.long:
        fail("dtype", f"{what} returned dtype {result.dtype}; return torch.long token ids, as argmax and "
                      f"multinomial do.")
    if bool((result < 0).any()) or bool((result >= logits.shape[1]).any()):
        fail("mismatch", f"{what} returned ids outside 0 .. {logits.shape[1] - 1}; the id of a token is its "
                         f"column in the logits.")
    return result


def _frequencies(draws: torch.Tensor, vocab: int) -> torch.Tensor:
    rows = draws.view(_REPEATS, _BASE.shape[0]).T                       # (2, repeats)
    return torch.stack([torch.bincount(r, minlength=vocab).double() / _REPEATS for r in rows])   # (2, vocab)


def _probabilities(logits: torch.Tensor, top_k: int | None = None, fill: float = float("-inf"),
                   smallest: bool = False) -> torch.Tensor:
    logits = logits.double()
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1, largest=not smallest).values[:, -1:]
        drop = logits > kth if smallest else logits < kth
        logits = logits.masked_fill(drop, fill)
    return logits.softmax(-1)


def _matches(freq: torch.Tensor, probs: torch.Tensor) -> bool:
    return bool((freq - probs).abs().max() < _TOLERANCE)


def _describe(freq: torch.Tensor, probs: torch.Tensor) -> str:
    row, token = divmod(int((freq - probs).abs().argmax()), probs.shape[1])
    return (f"token {token} of row {row} came up {freq[row, token]:.1%} of the time; it should be "
            f"{probs[row, token]:.1%}")


def _check_distribution(fn: Callable[..., Any], base: torch.Tensor, temperature: float,
                        top_k: int | None) -> None:
    logits = base.repeat(_REPEATS, 1)                                  # (2 * repeats, vocab)
    vocab = logits.shape[1]
    kwargs: dict[str, Any] = {"temperature": temperature}
    if top_k is not None:
        kwargs["top_k"] = top_k
    setting = f"temperature={temperature}" + (f", top_k={top_k}" if top_k is not None else "")
    what = f"sample_next_token({setting}) on {logits.shape[0]} rows"
    freq = _frequencies(_draw(fn, logits, what, **kwargs), vocab)
    expected = _probabilities(base / temperature, top_k)
    if _matches(freq, expected):
        return
    onehot = torch.nn.functional.one_hot(base.argmax(-1), vocab).double()
    if _matches(freq, onehot):
        fail("mismatch", f"{what}: you always return the most likely token, so there is no randomness. At "
                         f"{setting} draw from the distribution (torch.multinomial on the probabilities); only "
                         f"temperature=0 means argmax.")
    if bool((base > 0).all()) and _matches(freq, base.double() / base.double().sum(-1, keepdim=True)):
        fail("normalization", f"{what}: you sample in proportion to the raw logits. Logits are not "
                              f"probabilities: apply a softmax over the vocabulary first.")
    over_batch = (base / temperature).double().exp() / (base / temperature).double().exp().sum(0)
    if _matches(freq, over_batch / over_batch.sum(-1, keepdim=True)) or \
            _matches(freq, torch.full_like(freq, 1.0 / vocab)):
        fail("softmax_dim", f"{what}: the softmax runs over the batch (dim 0), not over the vocabulary; "
                            f"normalise each row, dim=-1.")
    if temperature != 1 and _matches(freq, _probabilities(base * temperature, top_k)):
        fail("scale", f"{what}: you multiply the logits by the temperature; divide them by it, so that a low "
                      f"temperature sharpens the distribution and a high one flattens it.")
    if temperature != 1 and _matches(freq, _probabilities(base, top_k)):
        fail("scale", f"{what}: the temperature has no effect. Divide the logits by it BEFORE the softmax "
                      f"(dividing the probabilities changes nothing once they are renormalised).")
    if top_k is not None:
        drawn = freq > 0   # 2500 draws per row: every token of probability >= 0.5% shows up
        for k in (top_k - 1, top_k + 1):
            kept = _probabilities(base / temperature, k) > 0 if 1 <= k <= vocab else None
            # judged by which tokens were drawn at all: k+1 and "no top_k" have close frequencies
            if kept is not None and bool((drawn == kept).all()) and \
                    _matches(freq, _probabilities(base / temperature, k)):
                fail("mismatch", f"{what}: you keep {k} tokens instead of top_k={top_k} (off by one in the "
                                 f"threshold: keep the logits >= the k-th largest).")
        if _matches(freq, _probabilities(base / temperature)):
            fail("mismatch", f"{what}: top_k has no effect: tokens outside the {top_k} most likely are still "
                             f"drawn. Set the other logits to -inf before the softmax.")
        if _matches(freq, _probabilities(base / temperature, top_k, fill=0.0)):
            fail("mismatch", f"{what}: the tokens outside the top {top_k} are still drawn sometimes: you set "
                             f"their logits to 0, which is still a fair chance. Use -inf, which gives exactly "
                             f"zero probability.")
        if _matches(freq, _probabilities(base / temperature, top_k, smallest=True)):
            fail("mismatch", f"{what}: you keep the {top_k} LEAST likely tokens; keep the most likely ones "
                             f"(topk returns the largest values first).")
        allowed = _probabilities(base / temperature, top_k) > 0
        if bool((freq[~allowed] > 0).any()):
            fail("mismatch", f"{what}: tokens outside the {top_k} most likely were drawn. With top_k, only the "
                             f"k highest logits may be drawn.")
    fail("mismatch", f"{what}: the draws do not follow softmax(logits / temperature): {_describe(freq, expected)}.")


def _check_generator_is_used(fn: Callable[..., Any], logits: torch.Tensor) -> None:
    """With a generator, the draws come from it: its state advances and the global RNG is left alone."""
    what = "sample_next_token(generator=...)"
    generator = torch.Generator().manual_seed(99)
    before_generator, before_global = generator.get_state(), torch.get_rng_state()
    _draw(fn, logits, what, generator=generator)
    if not torch.equal(torch.get_rng_state(), before_global):
        fail("generator", f"{what} used (or reseeded) the global random state although a generator was given: "
                          f"draw with it, torch.multinomial(probs, 1, generator=generator), and never call "
                          f"torch.manual_seed inside the sampler.")
    if torch.equal(generator.get_state(), before_generator):
        fail("generator", f"{what} never drew from the generator it was given: pass it on, "
                          f"torch.multinomial(probs, 1, generator=generator).")


@checker("5.4")
def check_sampling(fn: Callable[..., Any]) -> str:
    """fn(logits (N, V), temperature=1.0, top_k=None, generator=None) -> (N,) long."""
    torch.manual_seed(0)
    small = torch.tensor([[0.1, 3.0, -1.0, 0.5, 0.0, 1.0],
                          [2.0, -0.5, 0.3, 0.0, 1.5, -2.0],
                          [-1.0, -2.0, -0.5, -3.0, -0.7, -1.5]])
    _draw(fn, small, "sample_next_token(logits of shape (3, 6))")
    _draw(fn, small[:1], "sample_next_token(logits of shape (1, 6))")                 # a batch of one
    _draw(fn, small[:1], "sample_next_token(logits of shape (1, 6), temperature=0)", temperature=0)
    greedy = _draw(fn, small, "sample_next_token(temperature=0)", temperature=0)
    if not torch.equal(greedy, small.argmax(-1)):
        fail("mismatch", "With temperature=0 the sampler should be greedy and return the argmax of each row; "
                         f"yours returned {greedy.tolist()}, expected {small.argmax(-1).tolist()}.")
    _check_distribution(fn, _BASE, 1.0, None)
    _check_distribution(fn, _BASE + 3.0, 1.0, None)   # all positive: raw logits would not crash multinomial
    _check_distribution(fn, _BASE, 0.5, None)
    _check_distribution(fn, _BASE, 1.0, 3)
    _check_distribution(fn, _BASE, 2.0, 2)
    top1 = _draw(fn, _BASE.repeat(50, 1), "sample_next_token(top_k=1)", top_k=1)
    if not torch.equal(top1, _BASE.argmax(-1).repeat(50)):
        fail("mismatch", "With top_k=1 only the most likely token may be drawn; yours drew others.")
    logits = _BASE.repeat(20, 1)
    runs = []
    for seed in (1, 2):
        torch.manual_seed(seed)   # a different global state each time: only the generator may decide
        runs.append(_draw(fn, logits, "sample_next_token(generator=...)",
                          generator=torch.Generator().manual_seed(1234)))
    _check_generator_is_used(fn, logits)
    if not torch.equal(runs[0], runs[1]):
        fail("mismatch", "Two calls with generators seeded the same gave different tokens: pass `generator` on "
                         "to the random function you use (torch.multinomial(..., generator=generator)), so "
                         "that results can be reproduced.")
    return ("Greedy at temperature 0; otherwise draws follow softmax(logits / temperature), restricted to the top k "
            "when asked, and the generator makes them reproducible.")


register("5.4", "sample_next_token", [
    "Temperature 0 is the greedy special case: handle it first, with argmax over the vocabulary.",
    "Otherwise divide the logits by the temperature, softmax over the last dimension, then draw one token per row "
    "with torch.multinomial (pass the generator).",
    "top_k: find the k-th largest logit of each row (torch.topk) and set every logit below it to -inf before the "
    "softmax.",
], solution="course_lib.generate:sample_next_token")
