"""Exercises of notebook 06 (inference cost): 6.1 flops_per_token, 6.2 generate_with_cache."""
from __future__ import annotations

import copy
import itertools
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ... import generate as generate_ref
from ... import model as model_ref
from ... import train as train_ref
from ..exercises import Mistake
from ..verdict import Failure, fail
from ._device_probe import meta
from ._device_probe import probe as probe_device
from ._model_common import ProcedureExample, as_tensor, extend, randomize_, recording_calls
from ._student_code import call, expect_callable, expect_tensor
from .engine import Case, FunctionExercise, checker, function_example, judge
from .engine.function import Afresh, Number, Run
from .engine.probes import (
    IN_FLOAT64,
    called_in_turn,
    expect_dtype_kept,
    kept_state_message,
    random_or_kept,
    run_in_float64,
)

__all__ = ["check_flops_per_token", "check_kv_cache"]


# Sizes that differ in every factor, so that together they tell the slips below apart
# (the first has the baseline recipe's width and context).
_CONFIGS = (
    dict(vocab_size=65, max_tokens=64, embed_dim=128, num_heads=4, num_layers=2),
    dict(vocab_size=23, max_tokens=40, embed_dim=96, num_heads=3, num_layers=3),
    dict(vocab_size=11, max_tokens=128, embed_dim=64, num_heads=8, num_layers=1),
)


def _lhqt(config: Any) -> int:
    """n·H·Q·T: layers x heads x head size x context."""
    return config.num_layers * config.num_heads * config.head_dim * config.max_tokens


def _flops_what(config: Any, weights: int) -> str:
    return (f"flops_per_token(config with n={config.num_layers} layers, H={config.num_heads} heads of "
            f"Q={config.head_dim}, T={config.max_tokens}; num_weights={weights:,})")


# GPT-2 XL's sizes: about 1.6e9 weights, so 6N (about 1e10) is past what a 32-bit integer holds (2**31 - 1). Only
# its count is used, with a small configuration: code that builds the configuration's model (a recount of N, which
# the case of another count names) never builds a billion weights (6.5 GB and 45 s on a 2-core machine).
_LARGE = dict(vocab_size=50257, max_tokens=1024, embed_dim=1600, num_heads=25, num_layers=48)
_INT32 = 2 ** 31 - 1


def _weights_of(config: Any) -> int:
    """N of ``GPT(config).num_parameters(include_embeddings=False)``, counted from the sizes alone (a model of a
    billion weights is never built): the token embedding and the untied head (V·E each), the final LayerNorm
    (2E), and per block the four attention projections (4E²), the feed-forward (2·r·E²) and two LayerNorms (4E);
    no biases (the config's ``bias=False``)."""
    e, layers = config.embed_dim, config.num_layers
    return 2 * config.vocab_size * e + 2 * e + layers * ((4 + 2 * config.mlp_ratio) * e * e + 4 * e)


def _flops_cases(configs: tuple[dict[str, int], ...], other_weights: int | None = None, large: bool = False
                 ) -> list[Case]:
    """Each configuration with its GPT's own count of weights; with ``other_weights``, the first again with
    that count, which no configuration gives (the text: N is the argument, whatever model it counts); with
    ``large``, last, the first again with GPT-2 XL's count (counted from its sizes), where a count in int32
    overflows."""
    cases = []
    for sizes in configs:
        config = model_ref.GPTConfig(**sizes)
        weights = model_ref.GPT(config).num_parameters(include_embeddings=False)
        cases.append(Case((config, weights), _flops_what(config, weights)))
    if other_weights is not None:
        config = cases[0].args[0]
        cases.append(Case((config, other_weights), _flops_what(config, other_weights)))
    if large:
        config = cases[0].args[0]
        weights = _weights_of(model_ref.GPTConfig(**_LARGE))
        cases.append(Case((config, weights), _flops_what(config, weights) + " (GPT-2 XL's count of weights)"))
    return cases


def _config_fields(config: Any) -> dict[str, Any]:
    """Every field of the config as it is now (a copy: a list field changed in place shows too)."""
    fields = dict(vars(config)) if hasattr(config, "__dict__") else {}
    try:
        return copy.deepcopy(fields)
    except Exception:  # noqa: BLE001 - a field that will not copy is compared as it is
        return fields


def _config_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    missing = object()
    changes = []
    for name in [*before, *(name for name in after if name not in before)]:
        old, new = before.get(name, missing), after.get(name, missing)
        try:
            same = old is new or bool(old == new)
        except Exception:  # noqa: BLE001 - a value whose comparison raises has changed as far as we can tell
            same = False
        if same:
            continue
        if new is missing:
            changes.append(f"config.{name} was deleted")
        elif old is missing:
            changes.append(f"config.{name} was set to {new!r} (it was not there before)")
        else:
            changes.append(f"config.{name} was {old!r} and is {new!r} after the call")
    return changes


def _flops(count: Callable[[Any, int], float]) -> Callable[[Any, int], torch.Tensor]:
    return lambda config, weights: torch.tensor(float(count(config, weights)), dtype=torch.float64)


def _counted(fn: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """The student's count as a float64 tensor, once it is a finite number."""
    def count(config: Any, weights: int) -> torch.Tensor:
        what, before = _flops_what(config, weights), _config_fields(config)
        value = as_tensor(fn(config, weights))   # numpy becomes a tensor
        changed = _config_changes(before, _config_fields(config))
        if changed:   # before the number: a right count from a changed config still leaves the caller's changed
            if hasattr(config, "__dict__"):   # the case's config put back: the probes after this one read it
                vars(config).clear()
                vars(config).update(before)
            fail("mutation", f"{what} changed the config it was given: {'; '.join(changed[:3])}"
                             f"{f' (and {len(changed) - 3} more)' if len(changed) > 3 else ''}. The config is the "
                             f"caller's, the one their model was built from: do not change the config you are given. "
                             f"Read its fields into local variables (T = config.max_tokens), or change a copy "
                             f"(dataclasses.replace(config, max_tokens=...)).")
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            fail("dtype", f"{what} should return a number of FLOPs (an int or a float), but returned "
                          f"{'nothing (did you forget `return`?)' if value is None else type(value).__name__}.")
        try:
            finite = math.isfinite(value)
        except OverflowError:   # a whole number past any float
            fail("shape", f"{what} returned a whole number of {len(str(abs(int(value))))} digits, far past any count "
                          f"of FLOPs (and any float).")
        if not finite:
            fail("nan", f"{what} returned {value}; expected a finite number of FLOPs.")
        return torch.tensor(float(value), dtype=torch.float64)
    return count


@dataclass(frozen=True)
class _Count(FunctionExercise):
    """A count is right up to float rounding, not within the tolerance of computed tensors."""

    def same(self, out: Any, expected: torch.Tensor) -> bool:
        # past 2**31 a float32 count (24 bits) is off by its rounding, a few parts in 1e8: an estimate of FLOPs,
        # right; below it every count is a whole number float32 holds, and any slip shows there
        rel = 1e-9 if abs(float(expected)) < 2 ** 31 else 1e-6
        return isinstance(out, torch.Tensor) and out.shape == expected.shape and \
            math.isclose(float(out), float(expected), rel_tol=rel, abs_tol=1e-6)


def _one_term_off(runs: list[Run]) -> None:
    """No known slip explains the count, but on every configuration it is one term right and the other a
    constant multiple of its right value (3N, 24·n·H·Q·T): that term is named, with the factor counted."""
    def factors(left: Callable[[Any, int], float], unit: Callable[[Any, int], float]) -> set[float]:
        return {round((float(r.out) - left(*r.case.args)) / unit(*r.case.args), 6) for r in runs}
    run = runs[0]
    said = f"{run.case.what} returned {Number(run.out):,.0f}, expected {Number(run.expected):,.0f}"
    weights_factor = factors(lambda c, n: 12 * _lhqt(c), lambda c, n: n)
    if len(weights_factor) == 1:
        fail("flops_factor", f"{said}: the attention term is right, but the weights' term is "
                             f"{weights_factor.pop():g}N. Training costs 6N: 2N for the forward pass and 4N for the "
                             f"backward (dL/dX and dL/dW).")
    attention_factor = factors(lambda c, n: 6 * n, lambda c, n: _lhqt(c))
    if len(attention_factor) == 1:
        fail("attention_flops", f"{said}: the weights' term 6N is right, but your attention term is "
                                f"{attention_factor.pop():g}·n·H·Q·T where it is 12·n·H·Q·T: per token and layer, "
                                f"each of the H heads makes two products over the T keys (the scores QK^T and the "
                                f"weighted sum of the values), 2·Q·T FLOPs each forward, three times that with the "
                                f"backward pass.")


def _overflowed(runs: list[Run]) -> None:
    """``dtype`` where the count is right on the small counts and, on GPT-2 XL's count, off by a multiple of
    2**32: it was computed in 32-bit integers (np.int32, torch.int32), which wrap past 2**31 - 1."""
    wrong = [run for run in runs if not FLOPS_PER_TOKEN.same(run.out, run.expected)]
    if not wrong or any(abs(float(run.expected)) <= _INT32 for run in wrong):
        return
    run = wrong[0]
    got, expected = float(run.out), float(run.expected)
    if got.is_integer() and (int(got) - int(expected)) % 2 ** 32 == 0:
        fail("dtype", f"{run.case.what} returned {Number(run.out):,.0f}, expected {Number(run.expected):,.0f}: your "
                      f"count overflowed a 32-bit integer. It is right on the small models, but here 6N "
                      f"alone is {6 * run.case.args[1]:,}, past the int32 limit of {_INT32:,}, and int32 arithmetic "
                      f"(np.int32, torch.int32, a tensor of dtype int32) wraps around silently. Count with Python "
                      f"ints (int(...), which never overflow), or with int64 or float64.")


def _whole_factor(runs: list[Run]) -> None:
    """No known slip explains the count, but on every configuration it is the same multiple of the right one (both
    terms off by one factor): ``flops_factor``, the factor named (a multiply-add counted as 1 FLOP, the forward or
    the backward counted a wrong number of times)."""
    factors = {round(float(r.out) / float(r.expected), 6) for r in runs if float(r.expected)}
    if len(factors) != 1 or not all(r.case.args[1] for r in runs):
        return
    factor = factors.pop()
    said = (f"{round(factor)} times" if abs(factor - round(factor)) < 1e-6 else
            f"1/{round(1 / factor)} of" if abs(1 / factor - round(1 / factor)) < 1e-6 else f"{factor:.4g} times")
    run = runs[0]
    fail("flops_factor", f"{run.case.what} returned {Number(run.out):,.0f}, expected {Number(run.expected):,.0f}: "
                         f"your count is exactly {said} the right one on every configuration, so both terms carry "
                         f"the same wrong factor. Count a multiply-add as 2 FLOPs (a multiply and an add): the forward "
                         f"pass costs 2N + 4·n·H·Q·T, and the backward twice the forward (the gradients for the input "
                         f"and for the weights), 6 = 2 forward + 4 backward: 6N + 12·n·H·Q·T.")


def _rounded(runs: list[Run]) -> None:
    """``precision`` where every wrong count is the right one rounded to a power of ten (round(count, -3), a
    count to three significant digits, a floor or a ceiling there): the formula is right, its result rounded."""
    wrong = [run for run in runs if not FLOPS_PER_TOKEN.same(run.out, run.expected)]

    def rounded(got: float, exact: float) -> bool:
        return any(got == how(exact / 10 ** k) * 10 ** k for k in range(1, 16)
                   for how in (round, math.floor, math.ceil) if abs(exact) >= 10 ** k)
    if wrong and all(isinstance(run.out, torch.Tensor) and rounded(float(run.out), float(run.expected))
                     for run in wrong):
        run = wrong[0]
        fail("precision", f"{run.case.what} returned {Number(run.out):,.0f}, expected {Number(run.expected):,.0f}: "
                          f"your formula is right, but its result is rounded (to a power of ten, or to a few "
                          f"significant digits). Return the count exactly; round only where you print it.")


def _ignores_weights(runs: list[Run], fn: Any) -> None:
    _rounded(runs)
    _overflowed(runs)
    _whole_factor(runs)
    _one_term_off(runs)
    run = next(run for run in runs if not FLOPS_PER_TOKEN.same(run.out, run.expected))
    config, weights = run.case.args
    # a count that follows the configuration but not num_weights: N counted from the config (a constant is not)
    follows_config = len({float(r.out) for r in runs}) > 1
    more = call(fn, config, weights + 1000, what=run.case.what)
    if follows_config and FLOPS_PER_TOKEN.same(more, run.out):
        fail("weights_count", f"{run.case.what} returned {Number(run.out):,.0f}, expected "
                              f"{Number(run.expected):,.0f}, and gives the same number when num_weights changes: use "
                              f"the num_weights argument (N) for the 6N term.")
    if isinstance(more, torch.Tensor) and math.isclose(float(more) - float(run.out), 6000, abs_tol=1e-6):
        # the count grows by 6 per weight: 6N is there, and what does not depend on N is most likely attention
        rest = float(run.out) - 6 * weights
        for which, size in _EMBEDDINGS:   # ... unless on every configuration it is 12·n·H·Q·T and 6 embeddings
            for sign in (1, -1):
                if all(math.isclose(float(r.out), 6 * (r.case.args[1] + sign * size(r.case.args[0]))
                                    + 12 * _lhqt(r.case.args[0]), abs_tol=1e-6) for r in runs):
                    fail("weights_count", f"{run.case.what} returned {Number(run.out):,.0f}, expected "
                                          f"{Number(run.expected):,.0f}: " + _weights_said(which, sign))
        fail("attention_flops", f"{run.case.what} returned {Number(run.out):,.0f}, expected {Number(run.expected):,.0f}. "
                                f"Your count grows by 6 for every weight added, so 6N is there; what does not depend "
                                f"on num_weights is {Number(rest):,.0f}, where the attention term 12·n·H·Q·T = 12·"
                                f"{config.num_layers}·{config.num_heads}·{config.head_dim}·{config.max_tokens} = "
                                f"{12 * _lhqt(config):,}. Look at the attention term first: per token and layer, "
                                f"each of the H heads makes two products over the T keys (the scores QK^T and the "
                                f"weighted sum of the values), 2·Q·T FLOPs each forward, three times that with the "
                                f"backward pass, and all T keys count. If it is right, something else is added to "
                                f"(or taken from) 6N.")


def _slip(code: str, advice: str, count: Callable[[Any, int], float]) -> Mistake:
    return Mistake(code, "{what} returned {got:,.0f}, expected {expected:,.0f}: " + advice, output=_flops(count))


# Known slips, named only when one explains every configuration (with n = 2, leaving out the layers and
# counting one product per head give the same number); the message quotes the first wrong one.
# flops_factor: 2N or 4N where training costs 6N, or the attention term of the forward pass alone.
_FACTOR_SLIPS = (
    _slip("flops_factor", "you count the forward pass only (2N + 4·n·H·Q·T). Training also runs the backward "
          "pass, which needs two matrix multiplies for every one of the forward pass: three times the forward "
          "in all, so 6N and 12·n·H·Q·T.", lambda c, n: 2 * n + 4 * _lhqt(c)),
    _slip("flops_factor", "you count 2N, the forward pass of the weights alone. Training also runs the backward "
          "pass (two more matrix multiplies for every one of the forward pass, 6N in all), and attention adds "
          "12·n·H·Q·T.", lambda c, n: 2 * n),
    _slip("flops_factor", "the weights' term counts only the forward pass (2N). Backward needs the gradient for "
          "the input and the gradient for the weight, 4N more: 6N in all.", lambda c, n: 2 * n + 12 * _lhqt(c)),
    _slip("flops_factor", "the weights' term is 4N: forward (2N) plus only one of the two backward matrix "
          "multiplies. The backward pass computes both dL/dX and dL/dW, 2N each: 6N in all.",
          lambda c, n: 4 * n + 12 * _lhqt(c)),
    _slip("flops_factor", "your count is exactly 1/2 of the right one (3N + 6·n·H·Q·T): you count a multiply-add "
          "as one FLOP. A multiply-add is 2 FLOPs (a multiply and an add), so the forward pass costs 2N and "
          "4·n·H·Q·T, and training, three times the forward, 6N + 12·n·H·Q·T.",
          lambda c, n: 3 * n + 6 * _lhqt(c)),
    _slip("flops_factor", "your count is exactly 2/3 of the right one (4N + 8·n·H·Q·T): you count the backward pass "
          "as one more forward. The backward is twice the forward (the gradient for the input and the gradient for "
          "the weights, one matrix multiply each): 6 = 2 forward + 4 backward, so 6N + 12·n·H·Q·T.",
          lambda c, n: 4 * n + 8 * _lhqt(c)),
    _slip("flops_factor", "your count is exactly 1/6 of the right one (N + 2·n·H·Q·T): you count the forward pass "
          "only, and a multiply-add as one FLOP. A multiply-add is 2 FLOPs, and training runs the backward pass "
          "too, twice the forward: 6N + 12·n·H·Q·T.", lambda c, n: n + 2 * _lhqt(c)),
    _slip("flops_factor", "your count is exactly 2 times the right one (12N + 24·n·H·Q·T): the factor 2 of a "
          "multiply-add (or of the backward pass) is counted twice. A multiply-add is 2 FLOPs, forward and backward "
          "together are three times the forward: 6N + 12·n·H·Q·T.", lambda c, n: 12 * n + 24 * _lhqt(c)),
    _slip("attention_flops", "you count the weights (6N) but not attention. The scores QK^T and the weighted sum of "
          "the values multiply activations by activations, so they are not in N: add 12·n·H·Q·T.",
          lambda c, n: 6 * n),
    _slip("flops_factor", "the attention term counts only the forward pass (4·n·H·Q·T). Backward costs twice the "
          "forward here too: 12·n·H·Q·T.", lambda c, n: 6 * n + 4 * _lhqt(c)),
)

# The attention term 12·n·H·Q·T as a product of parts: each part's right value first, then the values students
# write instead, with what to tell them. Every combination of wrong parts is one slip (attention_flops).
_ATTENTION_PARTS: tuple[tuple[tuple[Callable[[Any], int], str], ...], ...] = (
    ((lambda c: 12, ""),
     (lambda c: 6, "the attention term is half of 12·n·H·Q·T: either it counts one product per head (there are "
                   "two: the scores QK^T and the weighted sum of the values, 2·Q·T FLOPs each per token in the "
                   "forward pass, 12·n·H·Q·T with the backward pass), or it halves the term for the causal mask "
                   "(the estimate ignores that saving and counts all T keys)."),
     (lambda c: 24, "the attention term is counted twice over (24·n·H·Q·T): the two products per head, the scores "
                    "(QK^T) and the weighted sum of the values, cost 2·Q·T FLOPs each per token forward, three "
                    "times that with the backward pass: 12·n·H·Q·T in all.")),
    ((lambda c: c.num_layers, ""),
     (lambda c: 1, "the attention term leaves out the number of layers: every block has its own attention. "
                   "Multiply by n = config.num_layers."),
     (lambda c: 2, "the attention term has 2 layers written into it: every block has its own attention, so "
                   "multiply by n = config.num_layers, whatever it is.")),
    ((lambda c: c.num_heads * c.head_dim, ""),
     (lambda c: c.head_dim, "the attention term leaves out the number of heads: each of the H heads has its own "
                            "scores and weighted sum. Use 12·n·H·Q·T (H·Q is embed_dim)."),
     (lambda c: c.num_heads, "the attention term leaves out the head size Q: each of a head's two products costs "
                             "2·Q FLOPs per key. Use 12·n·H·Q·T (H·Q is embed_dim)."),
     (lambda c: c.num_heads * c.embed_dim, "the attention term multiplies the number of heads by embed_dim. Q is "
                                           "the size of ONE head, config.head_dim = embed_dim // num_heads, so "
                                           "H·Q = embed_dim.")),
    ((lambda c: c.max_tokens, ""),
     (lambda c: c.max_tokens ** 2, "the attention term has T twice. Per token, its query meets T keys (and T "
                                   "values): T appears once. Per window of T tokens it is T², but this function "
                                   "counts per token."),
     (lambda c: c.vocab_size, "the attention term uses vocab_size where the context T = config.max_tokens "
                              "belongs: a query meets the T keys of its window, however large the vocabulary."),
     (lambda c: c.embed_dim, "the attention term uses embed_dim where the context T = config.max_tokens belongs: "
                             "a query meets the T keys of its window, whatever the width.")),
)


def _attention_slip(choice: tuple[tuple[Callable[[Any], int], str], ...]) -> Mistake:
    def count(c: Any, n: int) -> float:
        return 6 * n + math.prod(part(c) for part, _ in choice)
    return _slip("attention_flops", " Also, ".join(said for _, said in choice if said), count)


def _attention_slips() -> list[Mistake]:
    """Every combination of wrong parts, the fewest first; a combination whose product equals a simpler one's
    on every configuration (24·1 is 12·2) is left out: the simpler explanation names it."""
    choices = [choice for choice in itertools.product(*_ATTENTION_PARTS) if any(said for _, said in choice)]
    configs = [model_ref.GPTConfig(**sizes) for sizes in _CONFIGS]
    seen, kept = set(), []
    for choice in sorted(choices, key=lambda c: sum(bool(said) for _, said in c)):
        products = tuple(math.prod(part(c) for part, _ in choice) for c in configs)
        if products not in seen:
            seen.add(products)
            kept.append(_attention_slip(choice))
    return kept


def _unit_slip(window: bool, unit: str, scale: float) -> Mistake:
    """A right count in another unit: per window of T tokens instead of per token, or in G/M/kFLOPs."""
    count = _flops(lambda c, n: (6 * n + 12 * _lhqt(c)) * (c.max_tokens if window else 1) / scale)
    if not window:
        return Mistake("flops_units", "{what} returned {got:g}, which is the right count in " + unit + ". Return "
                                      "plain FLOPs ({expected:,.0f}); divide only when you print.", output=count)
    got = "{got:,.0f}" if scale == 1 else "{got:g}"
    return Mistake("flops_units", "{what} returned " + got + ", expected {expected:,.0f}: the result is T = max_tokens "
                                  "times too large: that is the count for a whole window of T tokens"
                                  + (f", in {unit}" if scale != 1 else "") + ". The function returns plain FLOPs "
                                  "per token.", output=count)


_UNITS = (("FLOPs", 1.0), ("GFLOPs", 1e9), ("MFLOPs", 1e6), ("kFLOPs", 1e3))

# The weights' term with the embeddings added to, or taken from, the num_weights given (N holds the token embedding,
# which is the tied head, and leaves the position embeddings out).
_EMBEDDINGS = (("the token embeddings (vocab_size·embed_dim)", lambda c: c.vocab_size * c.embed_dim),
               ("the position embeddings (max_tokens·embed_dim)", lambda c: c.max_tokens * c.embed_dim),
               ("the token and position embeddings", lambda c: (c.vocab_size + c.max_tokens) * c.embed_dim))


def _weights_said(which: str, sign: int) -> str:
    return (f"you {'add' if sign > 0 else 'subtract'} {which} {'to' if sign > 0 else 'from'} N. num_weights already "
            f"is N: every weight but the position embeddings (a lookup, not a matrix multiply), the token embedding "
            f"included (tied, it is the output head, which multiplies). Use 6·num_weights as given.")


def _weights_slip(which: str, size: Callable[[Any], int], sign: int) -> Mistake:
    return _slip("weights_count", _weights_said(which, sign), lambda c, n: 6 * (n + sign * size(c)) + 12 * _lhqt(c))


# N plus the position embeddings is what GPT(config).num_parameters() gives: left to _ignores_weights, which
# says to use the argument, as the code that counts the parameters itself has to be told.
_WEIGHTS_SLIPS = tuple(_weights_slip(which, size, sign) for sign in (1, -1) for which, size in _EMBEDDINGS
                       if (sign, which) != (1, _EMBEDDINGS[1][0]))


_SLIPS = (
    *_FACTOR_SLIPS,
    *_attention_slips(),
    *(_unit_slip(window, unit, scale) for window in (True, False) for unit, scale in _UNITS
      if window or scale != 1),
    *_WEIGHTS_SLIPS,
)

FLOPS_PER_TOKEN = _Count(
    "6.1", "flops_per_token", lambda config, weights: _flops(train_ref.flops_per_token)(config, weights),
    lambda: _flops_cases(_CONFIGS, other_weights=1_000_000, large=True), ("config", "num_weights"),
    success="6N + 12·n·H·Q·T, right for every configuration tried.",
    mismatch=lambda run: (f"{run.case.what} returned {Number(run.out):,.0f}, expected {Number(run.expected):,.0f} = "
                          f"6·{run.case.args[1]:,} + 12·{run.case.args[0].num_layers}·{run.case.args[0].num_heads}·"
                          f"{run.case.args[0].head_dim}·{run.case.args[0].max_tokens}."),
    mistakes=_SLIPS, values=lambda run: {"what": run.case.what}, exact=True, dtype=False, diagnose=_ignores_weights,
    examples=lambda: _flops_cases((dict(vocab_size=5, max_tokens=4, embed_dim=4, num_heads=2, num_layers=2),)),
)


@checker("6.1", example=lambda fn, *_, **__: function_example(FLOPS_PER_TOKEN)(_counted(fn)))
def check_flops_per_token(fn: Callable[..., Any]) -> str:
    """fn(config, num_weights) -> training FLOPs per token (6N + 12·n·H·Q·T)."""
    expect_callable(fn, "flops_per_token")
    verdict = judge(FLOPS_PER_TOKEN, _counted(fn))
    config, weights = FLOPS_PER_TOKEN.cases()[0].args
    return (f"{verdict} With embed {config.embed_dim} and a context of {config.max_tokens} the weights' term is "
            f"{6 * weights / (12 * _lhqt(config)):.0f} times the attention term (N counts the embeddings too; the "
            f"blocks alone give 6N ≈ 72·n·E² against 12·n·E·T, a ratio of 6E/T = "
            f"{6 * config.embed_dim / config.max_tokens:.0f}), so attention takes over once the context T is longer "
            f"than about 6 × embed_dim.")


def _model(max_tokens: int, embed_dim: int, seed: int) -> nn.Module:
    config = model_ref.GPTConfig(vocab_size=17, max_tokens=max_tokens, embed_dim=embed_dim, num_heads=2, num_layers=2)
    torch.manual_seed(seed)
    # large random weights: clear winners at every step, so float noise never flips an argmax
    return randomize_(model_ref.GPT(config), torch.Generator().manual_seed(seed)).eval()


# Where a loop with a forward of its own puts each new token: (the position, given the tokens already in the
# cache and the new token's index, what to tell the student). The right position is the cache's length.
_POSITION_SLIPS: tuple[tuple[Callable[[int, int], int], str], ...] = (
    (lambda cached, step: 0,
     "the positions of the new tokens are not offset: each new token is encoded at position 0. It sits at position "
     "cache length (the number of tokens already in the cache)."),
    (lambda cached, step: cached + 1,
     "each new token is encoded one position late: you read its position after appending it (idx.shape[1]). It "
     "sits at position cache length, the number of tokens already in the cache."),
    (lambda cached, step: step,
     "the positions of the new tokens count from the first generated token, leaving out the prompt. A new token "
     "sits at position cache length: the prompt's tokens come first."),
)


@torch.no_grad()
def _with_positions(model: nn.Module, idx: torch.Tensor, new: int, position: Callable[[int, int], int]
                    ) -> torch.Tensor:
    """Greedy decoding with a cache whose new tokens are encoded at ``position(cached, step)`` (a slip)."""
    cache = model.new_cache()
    logits = model(idx, cache)
    for step in range(new):
        next_id = logits[:, -1].argmax(-1, keepdim=True)           # (N, 1)
        idx = torch.cat([idx, next_id], dim=1)
        x = model.token_embedding(next_id) + model.position_encoding(1, position(cache[0].length, step))
        for block, layer_cache in zip(model.blocks, cache):
            x = block(x, layer_cache)
        logits = model.head(model.ln_f(x))
    return idx


def _draws_at_random(fn: Callable[..., Any], model: nn.Module, idx: torch.Tensor, new: int, what: str) -> str | None:
    """Why the student's tokens change from one call to the next (``random_or_kept``): "random" with the global random
    state (a sampler where greedy is asked), "kept" with an earlier call (a cache kept between calls), or None."""
    return random_or_kept(lambda: _run(fn, model, idx, new, what)[0],
                          lambda a, b: isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                          and a.shape == b.shape and bool(torch.equal(a, b)))


def _model_calls(calls: list[dict[str, Any]], block_calls: list[dict[str, Any]],
                 last_calls: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The model's calls; where model.forward(...) was called directly (no hook of the model runs), its first
    block's, which it calls in turn: their length and whether a cache went in, without the token ids; the cache
    then the first and the last block's of that call (``last_calls``), so that one shared by both shows."""
    if calls or not block_calls:
        return calls
    lasts = [c["cache"] for c in last_calls][:len(block_calls)]   # the last block's call of each, if it came
    lasts += [None] * (len(block_calls) - len(lasts))
    return [dict(c, shape=c["shape"][:2] if c["shape"] else None, ids=None, cache_length=None,
                 cache=c["cache"] if c["cache"] is None or last is None else [c["cache"], last])
            for c, last in zip(block_calls, lasts)]


def _shared_cache(calls: list[dict[str, Any]]) -> tuple[str, str] | None:
    """One cache object handed to several blocks in one call: a list made with `*`, or one object reused."""
    for c in calls:
        cache = c["cache"]
        if isinstance(cache, (list, tuple)) and len({id(layer) for layer in cache}) < len(cache):
            return ("kv_cache", "the same cache object goes to more than one block, so those blocks append their "
                                "keys and values to one cache and each reads the others' (it soon overflows). A list "
                                "made with `*` ([KVCache(...)] * n) repeats one object: make one KVCache per block, "
                                "model.new_cache() (or a list comprehension), and give block i its own cache[i].")
    return None


def _cache_key(cache: Any) -> Any:
    """One cache however it is handed over: model.new_cache()'s list, or a new list of the same layers."""
    return tuple(map(id, cache)) if isinstance(cache, (list, tuple)) else id(cache)


def _rows_holding(sequence: torch.Tensor, held: torch.Tensor, start: int = 0) -> list[int]:
    """The rows r at which the (b, n) tokens ``held`` are ``sequence[r:r + b, start:start + n]``."""
    b, n = held.shape
    if start + n > sequence.shape[1] or b > sequence.shape[0]:
        return []
    return [r for r in range(sequence.shape[0] - b + 1) if torch.equal(sequence[r:r + b, start:start + n], held)]


def _explain_cache_contents(calls: list[dict[str, Any]], sequence: torch.Tensor | None, prompt_length: int
                            ) -> tuple[str, str] | None:
    """What each cache was given, call by call (the tokens fed into it), against the student's own sequence:
    a cache used as intended holds the first tokens of its rows, each once, whatever the chunks fed."""
    held: dict[Any, torch.Tensor] = {}   # per cache, in the order of first use: the tokens fed into it
    refeeds: dict[Any, int] = {}
    emptied: list[torch.Tensor] = []     # what a cache held before it was emptied and fed again
    # a call of no tokens (a prefill of all the prompt but its last token, on a prompt of one) leaves a cache as it
    # was: neither a first use nor a start over
    cached = [c for c in calls if c["cache"] is not None and c["ids"] is not None and c["ids"].dim() == 2
              and c["ids"].shape[1] > 0]
    for number, c in enumerate(cached):
        key, ids = _cache_key(c["cache"]), c["ids"]
        before = held.get(key)
        if before is not None and c["cache_length"] == 0:   # the same cache emptied: it starts over
            emptied.append(held.pop(key))
            before = None
        if before is None:
            held[key] = ids
            continue
        if c["cache_length"] is not None and c["cache_length"] != before.shape[1]:
            return None   # tokens went into it, or out of it, some other way: nothing simple to say
        if before.shape[0] != ids.shape[0]:
            return None   # a cache fed batches of two sizes: nothing simple to say
        # fed again: the call starts with tokens the cache holds (its first ones, or its last ones)
        k = min(before.shape[1], ids.shape[1] - 1)
        refed = k > 0 and (torch.equal(ids[:, :k], before[:, :k]) or torch.equal(ids[:, :k], before[:, -k:]))
        refeeds[key] = refeeds.get(key, 0) + refed
        # with the student's tokens, a call is refeeding only if the cache then holds something no stretch of them
        # is (a prompt fed in chunks is not); without them, only a cache refed twice over counts
        if refed and (refeeds[key] >= 2 if sequence is None else not any(
                _rows_holding(sequence, torch.cat([before, ids], 1), s) for s in range(sequence.shape[1]))):
            growing = [x["ids"].shape[1] for x in cached[number:] if _cache_key(x["cache"]) == key]
            fed = ("the whole sequence again at every step" if len(growing) > 1 and all(
                b == a + 1 for a, b in zip(growing, growing[1:])) else f"{ids.shape[1]} tokens at a step")
            return ("kv_cache", f"after the prompt you feed {fed} into a cache that already holds every token "
                                f"before the newest, so the cache stores tokens twice (and soon overflows). Once the "
                                f"prompt is in the cache, feed only the newest token, shape (N, 1).")
        held[key] = torch.cat([before, ids], 1)
    if sequence is None:
        return None
    starts, claimed, restarts = [], set(), 0
    for tokens in [*emptied, *held.values()]:   # where each cache's tokens begin in the sequence, for which rows
        start = next((s for s in range(sequence.shape[1]) if _rows_holding(sequence, tokens, s)), None)
        starts.append(start)
        if start == 0:
            rows = [(r, tokens.shape[0]) for r in _rows_holding(sequence, tokens)]
            free = [r for r in rows if r not in claimed]
            restarts += not free
            claimed.add((free or rows)[0])
    late = [start for start in starts if start]
    if late:
        if len(held) + len(emptied) == len(cached) > 2 and all(c["ids"].shape[1] == 1 for c in cached[1:]):
            return ("no_kv_cache", "you start a new cache at every step, so each new token sees only itself. Create "
                                   "the cache once, before the loop, and keep passing it.")
        if min(late) < prompt_length:
            return ("kv_cache", f"the cache gets the prompt only from its token {min(late)} on, so the tokens before "
                                f"it are never seen. Run the whole prompt through the model with the cache first "
                                f"(model(idx, cache)), then feed only the newest token.")
        return ("kv_cache", "after the prompt, the new tokens go into a cache that never held the prompt (a new "
                            "cache, or the prompt run without one), so they see none of it. Run the prompt with the "
                            "cache the loop uses (model(idx, cache)) and pass that same cache to every later call.")
    if restarts:
        return ("no_kv_cache", "you start over with an empty cache at every step (a new one, or the same one "
                               "emptied) and feed it the whole sequence, so nothing is saved. Create the cache once "
                               "before the loop, then feed only the newest token.")
    return None


def _explain_calls(calls: list[dict[str, Any]], sequence: torch.Tensor | None = None, prompt_length: int = 0
                   ) -> tuple[str, str] | None:
    """(diagnosis, explanation) of what the recorded model calls say about a misused cache, if it was.
    ``sequence``: the student's tokens (N, L + new), where they returned them."""
    if not calls:
        return None   # model.forward(...) called directly bypasses the hook: nothing to say
    flat = next((c for c in calls if c["shape"] is not None and len(c["shape"]) != 2), None)
    if flat is not None:
        return ("shape", f"you feed the model token ids of shape {flat['shape']}; it takes (N, L). Keep the new "
                         f"token as (N, 1): argmax(-1, keepdim=True), or next_id[:, None].")
    if _shared_cache(calls):
        return _shared_cache(calls)
    if all(c["cache"] is None for c in calls):
        return ("no_kv_cache", "you never pass a cache to the model, so every step recomputes the whole sequence. "
                               "Create one with model.new_cache() before the loop and pass it to every call.")
    later = calls[1:]
    batch = calls[0]["shape"][0] if calls[0]["shape"] else None
    turned = next((c for c in later if c["shape"] and batch is not None and c["shape"][0] != batch
                   and c["shape"][1] == batch > 1), None)
    if turned is not None:
        return ("shape", f"after the prompt (a batch of {batch}) you feed token ids of shape {turned['shape']}: the "
                         f"batch and the token axes are swapped. The new tokens are (N, 1), one per sequence: "
                         f"argmax(-1, keepdim=True), or next_id[:, None], not unsqueeze(0).")
    uncached = [c for c in later if c["cache"] is None]
    if uncached and all(c["shape"] and c["shape"][1] == 1 for c in uncached):
        return ("no_kv_cache", "after the first call you call the model without the cache: the new token then sees "
                               "no earlier token. Pass the same cache to every call.")
    if uncached:
        return ("no_kv_cache", "after the first call you call the model without the cache, on more than the newest "
                               "token: those calls recompute what the cache was to keep. Pass the same cache to "
                               "every call and feed it only the newest token.")
    return _explain_cache_contents(calls, sequence, prompt_length)


_ONE_ROW = "logits[0, -1], .item(), a .squeeze() that drops the batch axis, or one token for every row"


def _right_row_by_row(fn: Callable[..., Any], model: nn.Module, idx: torch.Tensor, new: int, what: str) -> bool:
    """A batch of several prompts, each run alone (a batch of one), gives the right tokens every time."""
    if idx.shape[0] == 1:
        return False
    for row in idx.split(1):
        try:
            got, _ = _run(fn, model, row, new, what)
        except Failure:
            return False
        if not (isinstance(got, torch.Tensor) and got.shape == (1, row.shape[1] + new)
                and torch.equal(got, _greedy(model, row, new))):
            return False
    return True


def _one_sequence_for_all(got: torch.Tensor, expected: torch.Tensor, length: int, what: str) -> None:
    """``shape`` where one sequence's new tokens are right and every sequence got them: one token per step for
    the whole batch, taken from that sequence's logits (logits[0, -1].argmax(), broadcast to every row)."""
    new_tokens, right = got[:, length:], expected[:, length:]
    if new_tokens.shape[1] < 2:   # one token alike in every row may be chance
        return
    for row in range(got.shape[0]):
        if torch.equal(new_tokens[row], right[row]) and bool((new_tokens == new_tokens[row]).all()):
            fail("shape", f"{what}: your new tokens are right for sequence {row} only, and every other sequence "
                          f"gets the same ones: you take one token per step for the whole batch, from the logits of "
                          f"sequence {row} (logits[{row}, -1].argmax(), a batch of one assumed). Take the argmax per "
                          f"row: logits[:, -1].argmax(-1, keepdim=True), shape (N, 1), one new token per sequence.")


@torch.no_grad()
def _refeeding_last_prompt_token(model: nn.Module, idx: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy decoding that feeds the prompt, then its last token again before the first argmax (the slip of a
    loop that feeds idx[:, -1:] at the top): the cache holds that token twice, and each new token sits late."""
    cache = model.new_cache()
    model(idx, cache)
    for _ in range(new):
        logits = model(idx[:, -1:], cache)
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)   # (N, L + 1)
    return idx


def _run(fn: Callable[..., Any], model: nn.Module, idx: torch.Tensor, new: int, what: str
         ) -> tuple[Any, list[dict[str, Any]]]:
    with recording_calls(model) as calls, recording_calls(model.blocks[0]) as block_calls, \
            recording_calls(model.blocks[-1]) as last_calls:
        try:
            with torch.no_grad():
                result = call(fn, model, idx.clone(), new, what=what)
        except Failure as failure:
            recorded = _model_calls(calls, block_calls, last_calls)
            shared = _shared_cache(recorded) if failure.diagnosis == "exception" else None
            if shared:   # the model's error (a cache overflowing) follows from it: named first
                fail(shared[0], f"{what}: {shared[1]} The model's error comes from that (do not crop the prompt): "
                                f"{failure.message}")
            explanation = _explain_calls(recorded) if failure.diagnosis == "exception" else None
            if explanation:
                code = "shape" if explanation[0] == "shape" else "exception"
                fail(code, extend(failure.message, f"It looks like {explanation[1]}"))
            raise
    calls = _model_calls(calls, block_calls, last_calls)
    switched = [name or "model" for name, module in model.named_modules() if module.training]
    if switched:   # handed over in eval mode, as generation runs
        fail("dropout", f"{what}: your generation left {switched[0]} in training mode (model.train()); it was "
                        f"handed over in eval mode. In training mode dropout changes the logits at random, so "
                        f"greedy generation is no longer reproducible: leave the mode as the caller set it.")
    return result, calls


def _generation_cases() -> list[Case]:
    model = _model(max_tokens=8, embed_dim=8, seed=0)
    prompts = [(torch.tensor([[token]]), new) for token in (1, 2) for new in (1, 2, 3)]
    return [Case((model, idx, new), f"generate_with_cache(model, idx={idx.tolist()}, max_new_tokens={new}) on a tiny "
                                    f"GPT") for idx, new in prompts]


def _greedy(model: nn.Module, idx: torch.Tensor, new: int) -> torch.Tensor:
    return generate_ref.generate(model, idx, new, temperature=0, use_cache=False)


_GENERATION_EXAMPLE = ProcedureExample(_greedy, _generation_cases, ("model", "idx", "max_new_tokens"))


def _cache_kept(what: str, how: str) -> str:
    return (f"{what} {how}, yet the same call is right with your code as it was before the checker's first call "
            f"(its globals, default arguments and class attributes): your code keeps something from one call to the "
            f"next. A cache made once and kept (in a global, a default argument, on the model) still holds an earlier "
            f"call's tokens: make a new cache, model.new_cache(), in every call.")


def _right_afresh(start: Afresh, fn: Callable[..., Any], model: nn.Module, idx: torch.Tensor, new: int,
                  what: str) -> bool:
    """Whether the call gives the right tokens when the student's code starts afresh (``Afresh``: its globals,
    defaults and class attributes as before the check's first call)."""
    with start.restored():
        try:
            got, _ = _run(fn, model, idx, new, what)
        except Failure:
            return False
    return isinstance(got, torch.Tensor) and got.shape == (idx.shape[0], idx.shape[1] + new) and \
        bool(torch.equal(got, _greedy(model, idx, new)))


@checker("6.2", example=function_example(_GENERATION_EXAMPLE))
def check_kv_cache(fn: Callable[..., Any]) -> str:
    """fn(model, idx (N, L), max_new_tokens) -> (N, L + new): greedy, with model.new_cache()."""
    expect_callable(fn, "generate_with_cache")
    model = _model(max_tokens=16, embed_dim=16, seed=2)
    generator = torch.Generator().manual_seed(3)
    start = Afresh(fn)   # the student's code before the first call: a call that fails later may have kept state
    # the last asks for no new token: the docstring's (N, L + max_new_tokens) is then the prompt itself
    for batch, length, new in ((1, 1, 8), (2, 3, 6), (3, 7, 9), (2, 5, 1), (2, 4, 0)):
        idx = torch.randint(0, model.config.vocab_size, (batch, length), generator=generator)
        what = f"generate_with_cache(model, idx of shape {tuple(idx.shape)}, max_new_tokens={new})"
        try:
            got, calls = _run(fn, model, idx, new, what)
        except Failure as failure:
            if failure.diagnosis == "exception" and _right_afresh(start, fn, model, idx, new, what):
                fail("kept_state", _cache_kept(what, "raised an error"))
            if failure.diagnosis == "exception" and _right_row_by_row(fn, model, idx, new, what):
                fail("shape", extend(failure.message, f"Each sequence alone, a batch of one, generates the right "
                                                      f"tokens: your code assumes a batch of one ({_ONE_ROW}). Keep "
                                                      f"the batch axis: logits[:, -1].argmax(-1, keepdim=True), "
                                                      f"shape (N, 1), one new token per sequence."))
            raise
        if isinstance(got, torch.Tensor) and got.dim() == 2 and got.shape[0] == batch:
            starts_with_prompt = got.shape[1] >= length and torch.equal(got[:, :length], idx)
            if got.shape[1] == new and not starts_with_prompt:
                fail("shape", f"{what} returned only the {new} new tokens; return the prompt followed by them, "
                              f"shape {(batch, length + new)}.")
            if new and got.shape[1] == length and starts_with_prompt:
                fail("shape", f"{what} returned the prompt unchanged: append each new token to idx "
                              f"(torch.cat along dim 1).")
            if not new and got.shape[1] > length and starts_with_prompt:
                fail("shape", f"{what} returned {got.shape[1] - length} new token(s) although none was asked for: "
                              f"return the prompt unchanged. (A first token taken before the loop, then range("
                              f"max_new_tokens - 1), gives one token too many here.)")
            if got.shape[1] in (length + new - 1, length + new + 1):
                fail("shape", f"{what} returned {got.shape[1] - length} new token(s); generate exactly "
                              f"max_new_tokens = {new}.")
        expect_tensor(got, (batch, length + new), what, dtype=torch.long)
        expected = _greedy(model, idx, new)
        if not torch.equal(got[:, :length], idx):
            fail("mismatch", f"{what}: the first {length} tokens of the result should be the prompt itself.")
        explanation = _explain_calls(calls, got, length)
        if not torch.equal(got, expected) and _right_afresh(start, fn, model, idx, new, what):
            fail("kept_state", _cache_kept(what, "gives other tokens than generation without a cache"))
        if not torch.equal(got, expected):
            if explanation:
                fail(explanation[0], f"{what}: the tokens differ from generation without a cache; {explanation[1]}")
            if length + new <= model.config.max_tokens - 1 and torch.equal(got, _refeeding_last_prompt_token(
                    model, idx, new)):
                fail("kv_cache", f"{what}: the tokens differ from generation without a cache: after the prompt you "
                                 f"feed its LAST token again, so the cache holds it twice and every new token sits "
                                 f"one position late. The prompt's call already gives the logits for the first new "
                                 f"token: take the argmax of its last position, then feed only the tokens you "
                                 f"generate.")
            for position, said in _POSITION_SLIPS:
                try:
                    slipped = _with_positions(model, idx, new, position)
                except (ValueError, IndexError):   # positions past max_tokens: this slip cannot be what ran
                    continue
                if torch.equal(got, slipped):
                    fail("positions", f"{what}: {said}")
            changes = _draws_at_random(fn, model, idx, new, what)
            if changes == "kept":
                fail("kept_state", kept_state_message(
                    what, ", called twice in a row with torch's random state seeded alike before each call,",
                    "gives other tokens the second time", "generation"))
            if changes == "random":
                fail("greedy", f"{what}: the tokens differ from greedy generation and change from one call to the "
                               f"next: you draw them at random (torch.multinomial). This generation is greedy: take "
                               f"the argmax of the last position's logits at every step.")
            _one_sequence_for_all(got, expected, length, what)
            if _right_row_by_row(fn, model, idx, new, what):
                fail("shape", f"{what}: each sequence alone, a batch of one, generates the right tokens, but in a "
                              f"batch of {batch} they differ: your code assumes a batch of one ({_ONE_ROW}). Keep the "
                              f"batch axis: logits[:, -1].argmax(-1, keepdim=True), shape (N, 1), one new token per "
                              f"sequence.")
            step = int((got != expected).any(0).nonzero()[0]) - length
            fail("mismatch", f"{what}: the tokens differ from greedy generation without a cache from new token "
                             f"{step} on. Each step: argmax of the last position's logits, append it, feed only "
                             f"it to the model with the cache.")
        if explanation:
            fail(explanation[0], f"{what}: the tokens are right, but {explanation[1]}")
    # the same model, short prompts in turn (two of one batch, two of a batch of one): a cache kept between calls
    # (on the model, in a global) while it fits shows here
    prompts = [torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))
               for seed, shape in ((11, (2, 2)), (12, (2, 2)), (13, (1, 2)), (14, (1, 2)))]   # a batch of one too
    called_in_turn([(f"generate_with_cache(model, idx={idx.tolist()}, max_new_tokens=3)",
                     lambda idx=idx: _run(fn, model, idx, 3, "generate_with_cache(model, idx, 3)")[0],
                     lambda idx=idx: _greedy(model, idx, 3)) for idx in prompts],
                   thing="generation", same=lambda got, want: isinstance(got, torch.Tensor)
                   and got.shape == want.shape and bool(torch.equal(got, want)))
    _check_float64(fn)
    _check_grad_mode_left(fn, model)
    _check_device(fn, model)
    return "Token for token the same as generation without a cache." + _speed_note(fn)


class _GPTOnMeta(model_ref.GPT):
    """The course's GPT without the boundary check of its inputs, which reads the ids' numbers (that they lie in
    the vocabulary), so that it runs on meta ids: the same forward, the positions continuing after the cache's."""

    def _start_position(self, idx: torch.Tensor, cache: Any) -> int:
        return cache[0].length if cache else 0


def _check_device(fn: Callable[..., Any], model: nn.Module) -> None:
    """The device probe (the text asks for new tensors on the prompt's device): one generation with a copy of the
    model and the prompt on the meta device. Greedy generation reads no number (argmax, cat and the cache run on
    meta; the model's own range check of the ids is left out, ``_GPTOnMeta``), so a tensor made on the CPU (an output
    buffer without device=) or a token copied there shows; code that cannot run on meta for another reason (.item(),
    a branch on a token) is not judged here."""
    try:   # built afresh, not the model's class swapped: the grader's sandbox refuses a course object a new class
        moved = _GPTOnMeta(model.config).to("meta").train(model.training)
    except Exception:  # noqa: BLE001 - a model that cannot be built there: inconclusive
        return
    idx, new = torch.tensor([[1, 2], [3, 4]]), 3
    with torch.no_grad():
        probe_device(lambda: fn(moved, meta(idx), new),
                     f"generate_with_cache(model, idx of shape {tuple(idx.shape)}, max_new_tokens={new}) with the "
                     f"model and idx on another device")


def _check_grad_mode_left(fn: Callable[..., Any], model: nn.Module) -> None:
    """One call as a notebook cell makes it, with gradients on: every other call here runs under torch.no_grad(),
    where code that turns gradients off for the process (torch.set_grad_enabled(False)) changes nothing visible,
    and the student's later cells, training included, would run without them (``global_setting``)."""
    idx = torch.tensor([[1, 2]])
    with torch.enable_grad():
        call(fn, model, idx, 1, what=f"generate_with_cache(model, idx of shape {tuple(idx.shape)}, max_new_tokens=1) "
                                     f"called with gradients on, as a notebook cell calls it")


def _check_float64(fn: Callable[..., Any]) -> None:
    """The dtype probe, on what the default dtype reaches: a float64 model in a float64 notebook must still
    generate the reference's tokens and be left in float64 (``model.float()`` inside is ``dtype``)."""
    idx, new = torch.tensor([[1, 2], [3, 4]]), 4
    what = f"generate_with_cache(model, idx of shape {tuple(idx.shape)}, max_new_tokens={new}) on a float64 model " \
           f"{IN_FLOAT64}"

    def run() -> tuple[Any, torch.Tensor]:
        model = _model(max_tokens=8, embed_dim=8, seed=0)
        expected = _greedy(model, idx, new)
        got, _ = _run(fn, model, idx, new, what)
        expect_dtype_kept(model, torch.float64, what)
        return got, expected
    got, expected = run_in_float64(run)
    expect_tensor(got, tuple(expected.shape), what, dtype=torch.long)
    if not torch.equal(got, expected):
        fail("precision", f"{what}: the tokens {got.tolist()} differ from greedy generation without a cache "
                          f"{expected.tolist()}, which float64 does not explain: part of your generation runs in a "
                          f"lower precision. Keep the model's dtype throughout.")


def _speed_note(fn: Callable[..., Any]) -> str:
    """Time the student's cached generation against the uncached reference (reported, never judged)."""
    model = _model(max_tokens=64, embed_dim=64, seed=4)
    idx = torch.zeros(1, 1, dtype=torch.long)
    new = model.config.max_tokens - 1

    def timed(run: Callable[[int], Any], tokens: int) -> float:
        start = time.perf_counter()
        run(tokens)
        return time.perf_counter() - start

    try:
        with torch.no_grad():
            ours = lambda tokens: fn(model, idx, tokens)
            plain = lambda tokens: _greedy(model, idx, tokens)
            timed(ours, 3), timed(plain, 3)   # warm-up: the first calls pay for allocations
            cached, uncached = timed(ours, new), timed(plain, new)
    except Exception:  # the speed is only reported, never judged
        return ""
    ratio = uncached / max(cached, 1e-9)
    verdict = (f"{ratio:.1f}x faster" if ratio >= 1.1 else f"{1 / ratio:.1f}x SLOWER: does each step recompute "
               f"the whole sequence, or copy the cache?" if ratio <= 1 / 1.1 else "about the same speed")
    return (f" Speed: {new} new tokens took {cached * 1000:.0f} ms with your cache and {uncached * 1000:.0f} ms "
            f"without ({verdict}). On a model this small the fixed cost of each call dominates; the saving grows "
            f"with the length and the model size.")
