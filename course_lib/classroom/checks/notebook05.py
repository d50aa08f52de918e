"""Exercises of notebook 05 (training and sampling): 5.1 lm_windows, 5.2 lm_loss, 5.3 train_step,
5.4 sample_next_token."""
from __future__ import annotations

import copy
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ... import data as data_ref
from ... import model as model_ref
from ... import train as train_ref
from ..exercises import Mistake
from ..verdict import Failure, fail
from ._device_probe import probe as probe_device
from ._model_common import ProcedureExample, accepts, as_tensor, as_values, extend, recording_calls
from ._student_code import call, expect_callable, expect_tensor, reraise_with
from .engine import Case, FunctionExercise, checker, first_mistake, function_example, judge
from .engine.example import tiny
from .engine.function import Run
from .engine.probes import IN_FLOAT64, expect_dtype_kept, magnitude_rows, run_in_float64

__all__ = ["check_lm_windows", "check_lm_loss", "check_train_step", "check_sampling"]


# ---------------------------------------------------------------- 5.1 lm_windows

_OFFSET = 100   # token values 100, 101, ...: no value is a position, and each names one place in ids
_SHUFFLED = 12   # a case of this many ids in shuffled order: the next token is not the value plus one


def _windows_what(n: int, max_tokens: int, stride: int | None) -> str:
    return f"lm_windows(ids of length {n}, max_tokens={max_tokens}{'' if stride is None else f', stride={stride}'})"


def _windows_cases(sizes: tuple[tuple[int, int, int | None], ...], shuffled: bool = False) -> list[Case]:
    cases = [Case((torch.arange(_OFFSET, _OFFSET + n), t, s), _windows_what(n, t, s)) for n, t, s in sizes]
    if shuffled:
        ids = _OFFSET + torch.randperm(_SHUFFLED, generator=torch.Generator().manual_seed(0))
        cases.append(Case((ids, 3, None), _windows_what(_SHUFFLED, 3, None) + f" with ids {ids.tolist()}"))
    return cases


def _windows_pair(fn: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """The student's (inputs, targets) as one (2, num_windows, max_tokens) tensor, after the checks of a pair."""
    def windows(ids: torch.Tensor, max_tokens: int, stride: int | None) -> torch.Tensor:
        what = _windows_what(len(ids), max_tokens, stride)
        result = as_values(fn(ids, max_tokens) if stride is None else fn(ids, max_tokens, stride=stride), 2)
        stacked = as_tensor(result)   # numpy's stack too
        if isinstance(stacked, torch.Tensor) and stacked.dim() == 3 and len(stacked) == 2:
            result = tuple(stacked)   # the pair stacked, (2, num_windows, max_tokens): `x, y = ...` unpacks it alike
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            fail("dtype" if result is not None else "shape",
                 f"{what} should return a pair (inputs, targets), but returned "
                 f"{'nothing (did you forget `return`?)' if result is None else type(result).__name__}.")
        inputs, targets = (as_tensor(r) for r in result)
        for name, value in (("inputs", inputs), ("targets", targets)):
            if not isinstance(value, torch.Tensor):
                fail("dtype", f"{what}: {name} should be a torch.Tensor, got {type(value).__name__}.")
            if value.dtype != torch.long and value.dtype == ids.dtype:
                fail("dtype", f"{what}: {name} have dtype {value.dtype}, the dtype of ids: your windows keep the "
                              f"dtype they were cut from. Token ids must be torch.long whatever the dtype of ids "
                              f"(the embedding and the cross-entropy targets need it): cast with ids.long() before "
                              f"cutting, or .long() on each result.")
            if value.dtype != torch.long:
                fail("dtype", f"{what}: {name} have dtype {value.dtype}; token ids must be torch.long "
                              f"(the embedding and the cross-entropy targets need integers).")
        shape = (len(range(0, len(ids) - max_tokens, stride or max_tokens)), max_tokens)
        if inputs.dim() != 2 or targets.dim() != 2:
            fail("shape", f"{what}: inputs and targets should each be 2-D, (num_windows, max_tokens) = "
                          f"{shape}; got {tuple(inputs.shape)} and {tuple(targets.shape)}.")
        if max_tokens + 1 in (inputs.shape[1], targets.shape[1]):
            fail("shape", f"{what}: your windows hold max_tokens + 1 = {max_tokens + 1} tokens. Cut max_tokens + "
                          f"1 tokens, then the inputs are all but the last of them and the targets all but the "
                          f"first, max_tokens each.")
        if max_tokens - 1 in (inputs.shape[1], targets.shape[1]):
            fail("shape", f"{what}: your windows hold max_tokens - 1 = {max_tokens - 1} tokens (off by one). Each "
                          f"chunk needs max_tokens + 1 tokens, so that inputs and targets are max_tokens long.")
        if inputs.shape != targets.shape:
            fail("shape", f"{what}: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} should have "
                          f"the same shape, {shape}.")
        if inputs.shape[1] != max_tokens:
            fail("shape", f"{what}: each window should hold max_tokens = {max_tokens} tokens, yours hold "
                          f"{inputs.shape[1]}.")
        return torch.stack([inputs, targets])                   # (2, num_windows, max_tokens)
    return windows


def _places(ids: torch.Tensor, values: torch.Tensor) -> list[int | None]:
    """Where each value stands in ids (the cases' ids are distinct), None for a value ids does not hold."""
    where = {int(v): place for place, v in enumerate(ids.tolist())}
    return [where.get(int(v)) for v in values]


def _starts(out: torch.Tensor, ids: torch.Tensor) -> tuple[list[int | None], set[int]]:
    """Where each of the student's windows starts in ids, and the steps between them."""
    starts = _places(ids, out[0, :, 0]) if out.numel() else []
    return starts, {b - a for a, b in zip(starts, starts[1:]) if a is not None and b is not None}


def _windows_count(case: Case, out: Any) -> None:
    """Too many or too few windows: overlapping, spaced too far, the last missing, or one too many."""
    ids, max_tokens, stride = case.args
    stride = stride or max_tokens
    count, (starts, steps) = len(range(0, len(ids) - max_tokens, stride)), _starts(out, ids)
    if steps and 0 < min(steps) and max(steps) < stride:
        every = "at every token" if steps == {1} else f"every {sorted(steps)[0]} tokens"
        fail("overlapping_windows", f"{case.what}: your windows overlap: one starts {every} ({len(starts)} "
                                    f"windows). Here windows start every {stride} tokens ({count} windows), so "
                                    f"each token is a target once.")
    if out.shape[1] == count:
        return
    if steps == {max_tokens + 1} and stride == max_tokens:
        fail("shape", f"{case.what}: consecutive windows start max_tokens + 1 = {max_tokens + 1} tokens apart, so "
                      f"one token in every window is never a target. Start them max_tokens = {max_tokens} apart: "
                      f"the last target of one window is the first input of the next.")
    if starts and starts[0] not in (None, 0):
        fail("shape", f"{case.what}: {out.shape[1]} windows where {count} fit, and the first starts at token "
                      f"{starts[0]}: start at the beginning of ids, token 0, then every {stride} tokens.")
    if steps <= {stride} and out.shape[1] == count - 1:
        fail("shape", f"{case.what}: the last window is missing although it fits: a window starting at s needs "
                      f"tokens s .. s + max_tokens, so it fits when s + max_tokens + 1 <= len(ids) ({len(ids)} "
                      f"here). Check the range of your start positions.")
    if steps <= {stride} and out.shape[1] > count:
        fail("shape", f"{case.what}: {out.shape[1]} windows, but only {count} fit completely; drop a last window "
                      f"that would run past the end instead of padding or wrapping it.")
    fail("shape", f"{case.what}: expected {count} windows (starting every {stride} tokens), got {out.shape[1]}.")


def _shifted(ids: torch.Tensor, max_tokens: int, stride: int | None, shift: int) -> torch.Tensor | None:
    """The reference's inputs with targets ``shift`` tokens ahead (None where the last window runs out)."""
    inputs = data_ref.lm_windows(ids, max_tokens, stride)[0]
    starts = _places(ids, inputs[:, 0])
    if not starts or starts[-1] + shift + max_tokens > len(ids):
        return None
    return torch.stack([inputs, torch.stack([ids[s + shift:s + shift + max_tokens] for s in starts])])


def _windows_of_int32_ids(runs: list[Run], fn: Any) -> None:
    """``dtype``: every case right (int64 ids), then ids of int32, as a tokenizer's numpy array may give them: the
    windows are torch.long whatever the dtype of ids (``_windows_pair`` judges the pair's dtype)."""
    call(fn, torch.arange(_OFFSET, _OFFSET + 13, dtype=torch.int32), 4, None,
         what=_windows_what(13, 4, None) + " with int32 ids")


def _windows_spacing(runs: list[Run], fn: Any) -> None:
    run = runs[0]
    stride = run.case.args[2] or run.case.args[1]
    ids = run.case.args[0]
    starts, steps = _starts(run.out, ids)
    if starts and starts[0] is None:
        fail("mismatch", f"{run.case.what}: your first window begins with the value {int(run.out[0, 0, 0])}, "
                         f"which is not a token of ids: cut the windows out of ids (ids[s : s + max_tokens + 1]), "
                         f"not out of positions such as torch.arange.")
    if steps and steps != {stride}:
        fail("mismatch", f"{run.case.what}: your windows start {sorted(steps)} tokens apart; they should start "
                         f"every {stride} tokens.")
    if starts and starts[0] != 0:
        fail("mismatch", f"{run.case.what}: the first window starts at token {starts[0]}; it should start at the "
                         f"beginning of ids.")


LM_WINDOWS = FunctionExercise(
    "5.1", "lm_windows", lambda ids, max_tokens, stride: torch.stack(data_ref.lm_windows(ids, max_tokens, stride)),
    lambda: _windows_cases(((21, 4, None), (20, 4, None), (9, 8, None), (30, 3, None), (6, 1, None)), shuffled=True),
    ("ids", "max_tokens", "stride"),
    success="Windows of max_tokens inputs, targets one step ahead, a last window that doesn't fit dropped.",
    mismatch=lambda run: (f"{run.case.what}: the windows hold other tokens than expected. Window w starts at token "
                          f"w * stride; its inputs are max_tokens tokens from there and its targets the same "
                          f"tokens one step later."),
    mistakes=(
        Mistake("target_shift", "the targets are the inputs themselves. The target at each position is the NEXT "
                                "token, so targets are the inputs shifted by one to the left (one step ahead).",
                output=lambda ids, t, s: data_ref.lm_windows(ids, t, s)[0].expand(2, -1, -1)),
        Mistake("target_shift", "targets are shifted the wrong way: your target at position j is the token BEFORE "
                                "input j. The model predicts what comes next, so target j is the token after input j.",
                output=lambda ids, t, s: torch.stack(data_ref.lm_windows(ids, t, s)[::-1])),
        Mistake("target_shift", "you roll the inputs to make the targets, so each window's last target wraps round to "
                                "its first input. The last target is the token AFTER the window: cut max_tokens + 1 "
                                "tokens, inputs all but the last, targets all but the first.",
                output=lambda ids, t, s: torch.stack([(w := data_ref.lm_windows(ids, t, s)[0]), w.roll(-1, 1)])),
        Mistake("target_shift", "your targets are two tokens ahead of the inputs; the target at position j is the "
                                "NEXT token, one step ahead.",
                output=lambda ids, t, s: _shifted(ids, t, s, 2)),
        Mistake("target_shift", "your targets are the input VALUES plus one, not the next tokens: token ids are "
                                "names, not numbers that count up. The targets are the tokens that follow the "
                                "inputs in ids, ids[s + 1 : s + max_tokens + 1].",
                output=lambda ids, t, s: torch.stack([(w := data_ref.lm_windows(ids, t, s)[0]), w + 1])),
    ),
    exact=True, each_case=True, raw=_windows_count, diagnose=_windows_spacing, after=_windows_of_int32_ids,
    reword=lambda failure, case, out, fn: _windows_of_unequal_size(failure),
    examples=lambda: _windows_cases(((5, 2, None), (7, 2, None), (7, 3, None))),
)


def _windows_of_unequal_size(failure: Failure) -> None:
    """A stack of windows of unequal sizes: the last window, cut short, was kept."""
    if failure.diagnosis == "exception" and "stack expects each tensor to be equal size" in failure.message:
        reraise_with(failure, "exception", " Your last window is shorter than the others: a window needs max_tokens "
                                           "+ 1 tokens (its inputs and, one step ahead, its targets), so (len(ids) - "
                                           "1) // max_tokens windows fit at stride max_tokens. Drop a last window "
                                           "that does not fit.")


@checker("5.1", example=lambda fn, *_, **__: function_example(LM_WINDOWS)(_windows_pair(fn)))
def check_lm_windows(fn: Callable[..., Any]) -> str:
    """fn(ids (T,) long, max_tokens) -> (inputs, targets), each (num_windows, max_tokens)."""
    expect_callable(fn, "lm_windows")
    strided = replace(LM_WINDOWS, cases=lambda: LM_WINDOWS.cases() + _windows_cases(((21, 4, 2), (17, 3, 5))))
    return judge(strided if accepts(fn, "stride", named=True) else LM_WINDOWS, _windows_pair(fn))


# ---------------------------------------------------------------- 5.2 lm_loss

IGNORE = -100
_SHAPE_ERROR = re.compile(r"batch_size|target size|spatial targets|size mismatch|shape|dimension", re.I)


def _loss_what(logits: torch.Tensor, targets: torch.Tensor) -> str:
    padded = targets.device.type != "meta" and bool((targets == IGNORE).any())   # meta: the device probe's copy
    return (f"lm_loss(logits {tuple(logits.shape)}, targets {tuple(targets.shape)}"
            + (", with -100 padding)" if padded else ")"))


def _loss_cases(sizes: tuple[tuple[int, int, int, int], ...], seed: int, small: bool = False) -> list[Case]:
    generator, cases = torch.Generator().manual_seed(seed), []
    for n, length, vocab, pad in sizes:
        logits = tiny(generator, n, length, vocab) if small else 2.0 * torch.randn(n, length, vocab, generator=generator)
        targets = torch.randint(0, vocab, (n, length), generator=generator)
        if pad:
            targets[1:, -pad:] = IGNORE   # padded rows, the first row complete
        cases.append(Case((logits, targets), _loss_what(logits, targets)))
    return cases


def _loss_of(fn: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """The student's loss as a 0-d tensor, after the checks of a loss (a number, one loss per token, no graph)."""
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        what, got = _loss_what(logits, targets), fn(logits, targets)
        if isinstance(got, numbers.Real) and not isinstance(got, bool):
            fail("dtype", f"{what} returned a Python number. Return the loss tensor itself: .item() cuts it off "
                          f"from the graph, and loss.backward() needs the tensor.")
        got = as_tensor(got)
        if isinstance(got, torch.Tensor) and got.dim() > 0 and got.numel() == targets.numel():
            fail("shape", f"{what} returned one loss per token, shape {tuple(got.shape)}; the loss is their "
                          f"mean over the real targets, a single number.")
        if isinstance(got, torch.Tensor) and got.numel() == 1 and got.dim() > 0:
            got = got.reshape(())
        if logits.requires_grad and isinstance(got, torch.Tensor) and not got.requires_grad:   # the gradient probe
            fail("gradient", f"{what}: the loss has the right value but is cut off from the logits (no gradient "
                             f"can flow back). Avoid .item(), .detach(), torch.no_grad() or numpy inside lm_loss.")
        return got
    return loss


def _loss_error(failure: Failure, case: Case, out: Any, fn: Any) -> None:
    """A crash on -100 or on the layout of (N, L, V): say what cross-entropy expects."""
    if failure.diagnosis != "exception":
        return
    if "-100" in failure.message or "out of bounds" in failure.message:
        fail("loss_reduction", extend(failure.message, "Targets of -100 mark padding: ignore them (F.cross_entropy "
                                                       "does so by default) instead of using them as an index."))
    if _SHAPE_ERROR.search(failure.message):
        fail("shape", extend(failure.message, "F.cross_entropy expects logits (N, C) with targets (N,), or (N, C, L) "
                                              "with (N, L): the classes go in dimension 1. Flatten logits to "
                                              "(N*L, V) and targets to (N*L,)."))


def _position_means(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss averaged over the batch at each position, then over the positions that hold a real target."""
    per = _per_token(logits, targets).view(targets.shape)                   # (N, L)
    real = (targets != IGNORE).double()
    counts = real.sum(0)
    return ((per * real).sum(0)[counts > 0] / counts[counts > 0]).mean()


def _kept_rows(logits: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor) -> torch.Tensor | None:
    """The loss of the rows ``keep`` marks alone (None where it keeps them all, or none)."""
    if bool(keep.all()) or not bool(keep.any()):
        return None
    return F.cross_entropy(logits[keep].flatten(0, 1), targets[keep].flatten(), ignore_index=IGNORE)


def _per_token(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none")


def _label_smoothing(logits: torch.Tensor, targets: torch.Tensor, loss: float) -> float | None:
    """The label_smoothing e that gives ``loss`` on these logits, or None: a smoothed loss is (1 - e) times the
    cross-entropy plus e times the mean over the vocabulary of -log p, so e is a straight line's solution."""
    real = targets != IGNORE
    plain = float(_per_token(logits, targets)[real.flatten()].mean())
    uniform = float(-logits.double().log_softmax(-1)[real].mean())
    if abs(uniform - plain) < 1e-6:
        return None
    smoothing = (loss - plain) / (uniform - plain)
    return smoothing if 1e-3 < smoothing <= 1 else None


def _smoothed_labels(runs: list[Run], fn: Any) -> None:
    """``mismatch`` naming label smoothing: the first wrong loss is the smoothed loss for some e, and the other
    cases' losses are too, with that same e (a recipe's label_smoothing=0.1 left in)."""
    run = runs[-1]
    smoothing = _label_smoothing(*run.case.args, float(run.out))
    if smoothing is None:
        return
    for case in LM_LOSS.cases():
        try:
            got = call(fn, *case.given(), what=case.what)
        except Failure:
            return
        smoothed = F.cross_entropy(case.args[0].flatten(0, 1), case.args[1].flatten(), ignore_index=IGNORE,
                                   label_smoothing=smoothing)
        if not (isinstance(got, torch.Tensor) and got.numel() == 1 and abs(float(got) - float(smoothed)) < 1e-4):
            return
    fail("mismatch", f"{run.case.what} returned {float(run.out):.5f}, expected {float(run.expected):.5f}: your loss "
                     f"is the cross-entropy with label smoothing (label_smoothing={smoothing:.3g}), which mixes a "
                     f"uniform target over the vocabulary into each real one. The loss asked is the plain mean "
                     f"cross-entropy against the targets: leave label_smoothing out of F.cross_entropy.")


LM_LOSS = FunctionExercise(
    "5.2", "lm_loss", lambda logits, targets: train_ref.lm_loss(logits, targets),
    lambda: _loss_cases(((2, 5, 7, 0), (3, 4, 4, 0), (1, 1, 9, 0), (3, 6, 11, 2), (2, 7, 7, 3)), 5),
    ("logits", "targets"),
    success="Mean cross-entropy over the real targets, -100 ignored, gradients flow back.",
    mismatch=lambda run: (f"{run.case.what} returned {run.out.item():.5f}, expected {run.expected.item():.5f}: the "
                          f"mean cross-entropy of the logits against the targets, ignoring -100."),
    mistakes=(
        Mistake("logits", "you apply a softmax before the cross-entropy. F.cross_entropy takes raw logits and "
                          "applies the (log-)softmax itself, so yours is applied twice.",
                output=lambda x, y: F.cross_entropy(x.flatten(0, 1).softmax(-1), y.flatten(), ignore_index=IGNORE)),
        Mistake("logits", "you pass raw logits to F.nll_loss, which expects log-probabilities: use F.cross_entropy "
                          "on the logits (or log_softmax first).",
                output=lambda x, y: F.nll_loss(x.flatten(0, 1), y.flatten(), ignore_index=IGNORE)),
        Mistake("logits", "you pass probabilities (a softmax without the log) to F.nll_loss, which expects "
                          "log-probabilities: use F.cross_entropy on the raw logits (or F.log_softmax first).",
                output=lambda x, y: F.nll_loss(x.flatten(0, 1).softmax(-1), y.flatten(), ignore_index=IGNORE)),
        Mistake("loss_reduction", "your loss is the SUM over tokens; the loss is the MEAN over the target tokens (so "
                                  "it does not grow with the batch size or length).",
                output=lambda x, y: _per_token(x, y).sum()),
        Mistake("loss_reduction", "you average over every position, padding included: the ignored targets (-100) "
                                  "should not count in the mean either. Divide by the number of real targets.",
                output=lambda x, y: _per_token(x, y).sum() / y.numel()),
        Mistake("loss_reduction", "each sequence gets averaged separately and then the sequences are averaged: every "
                                  "target token should weigh the same, so average over all real targets at once.",
                output=lambda x, y: torch.stack([F.cross_entropy(x[i], y[i], ignore_index=IGNORE)
                                                 for i in range(len(x)) if bool((y[i] != IGNORE).any())]).mean()),
        Mistake("loss_reduction", "you divide the summed loss by the batch size N (one loss per sequence); the loss "
                                  "is the MEAN over the real target tokens: divide by their number.",
                output=lambda x, y: _per_token(x, y).sum() / x.shape[0] if x.shape[1] > 1 else None),
        Mistake("loss_reduction", "targets of -100 are not ignored: -100 marks padding and must not contribute to the "
                                  "loss (F.cross_entropy ignores it by default, unless you change ignore_index or the "
                                  "targets).",
                output=lambda x, y: F.cross_entropy(x.flatten(0, 1), y.flatten().clamp(min=0))),
        Mistake("loss_reduction", "you average each position over the batch first, then the positions: every "
                                  "target token should weigh the same, so average over all real targets at once.",
                output=lambda x, y: _position_means(x, y)),
        Mistake("loss_reduction", "you ignore the targets equal to 0 (ignore_index=0): token 0 is a real token. "
                                  "Padding is -100, which F.cross_entropy ignores by default.",
                output=lambda x, y: None if bool((y == IGNORE).any())   # -100 is then out of bounds: raises
                else F.cross_entropy(x.flatten(0, 1), y.flatten(), ignore_index=0)),
        Mistake("target_shift", "you shift the logits and targets again (logits[:, :-1] against targets[:, 1:]): "
                                "the targets lm_windows made are already the next tokens, one step ahead of the "
                                "inputs, so each position is now scored against the token two ahead. Compare "
                                "logits[:, t] with targets[:, t].",
                output=lambda x, y: F.cross_entropy(x[:, :-1].flatten(0, 1), y[:, 1:].flatten(), ignore_index=IGNORE)
                if x.shape[1] > 1 else None),
        Mistake("target_shift", "your targets are flattened in another order than the logits (targets.T, or a "
                                "transpose or permute on one of the two only): the logits flattened to (N*L, V) "
                                "go sequence by sequence, so each is scored against another position's target. "
                                "Flatten both the same way, logits.reshape(-1, V) with targets.reshape(-1).",
                output=lambda x, y: F.cross_entropy(x.flatten(0, 1), y.T.reshape(-1), ignore_index=IGNORE)
                if x.shape[0] > 1 and x.shape[1] > 1 else None),
        Mistake("target_shift", "your logits are flattened in another order than the targets (logits.transpose(0, 1) "
                                "or a permute before the reshape, the targets as they are): the logits go position "
                                "by position, the targets sequence by sequence, so each position is scored against "
                                "another position's target. Flatten both the same way, logits.reshape(-1, V) with "
                                "targets.reshape(-1).",
                output=lambda x, y: F.cross_entropy(x.transpose(0, 1).reshape(-1, x.shape[-1]), y.reshape(-1),
                                                    ignore_index=IGNORE)
                if x.shape[0] > 1 and x.shape[1] > 1 else None),
        Mistake("shape", "you reshape the logits (N, L, V) to (N, V, L) with view or reshape to put the classes in "
                         "dimension 1, but a reshape keeps the memory order: it does not move the vocabulary, it "
                         "cuts each sequence's numbers into V rows of L, mixing positions and tokens. Move the axis "
                         "with logits.transpose(1, 2) (or permute(0, 2, 1)), or flatten to (N*L, V) and (N*L,).",
                output=lambda x, y: F.cross_entropy(x.reshape(x.shape[0], x.shape[2], x.shape[1]), y,
                                                    ignore_index=IGNORE) if 1 < x.shape[1] != x.shape[2] else None),
        Mistake("shape", "F.cross_entropy expects the classes in dimension 1, (N, C, ...), but you pass (N, L, V) as "
                         "it is, so it takes the positions for the classes. Flatten to (N*L, V) and (N*L,), or move "
                         "the vocabulary to dimension 1.",
                output=lambda x, y: F.cross_entropy(x, y, ignore_index=IGNORE) if 1 < x.shape[1] == x.shape[2]
                else None),
        Mistake("loss_reduction", "you drop every sequence that holds any padding, its real targets too: the "
                                  "mean is over the tokens that are not ignored, not over whole sequences. Keep "
                                  "every sequence and ignore only the targets equal to -100 (F.cross_entropy does "
                                  "so by default).",
                output=lambda x, y: _kept_rows(x, y, ~(y == IGNORE).any(1))),
        Mistake("loss_reduction", "you cut every sequence to the shortest one's length (the positions where any "
                                  "sequence is padded are dropped for all of them): the mean is over the tokens that "
                                  "are not ignored, each sequence's own. Keep every position and ignore only the "
                                  "targets equal to -100 (F.cross_entropy does so by default).",
                output=lambda x, y: _kept_rows(x.transpose(0, 1), y.T, ~(y == IGNORE).any(0))),
        *(Mistake("batch_mixing", f"your loss is the loss of the {which} sequence of the batch alone: the other "
                                  f"sequences are left out. The loss is the mean over every real target of every "
                                  f"sequence: flatten the batch and the positions together, logits.reshape(-1, V) "
                                  f"with targets.reshape(-1), and never index one sequence (logits[0]) or keep only "
                                  f"the last one a loop over the batch computed.",
                  output=lambda x, y, rows=rows: train_ref.lm_loss(x[rows], y[rows]) if x.shape[0] > 1 else None)
          for which, rows in (("first", slice(None, 1)), ("last", slice(-1, None)))),
        Mistake("loss_reduction", "the -100 targets are not ignored the right way; the mean runs over the real "
                                  "targets only.",
                output=lambda x, y: _per_token(x, y)[y.flatten() != IGNORE].sum() / y.numel()
                if bool((y == IGNORE).any()) else None),
        *(Mistake("softmax_dim", f"your log-softmax runs over the {axis}, not over the vocabulary: each position's "
                                 f"probabilities are over its V tokens, log_softmax(logits, dim=-1).",
                  output=lambda x, y, dim=dim: -x.log_softmax(dim).gather(-1, y.clamp(min=0)[..., None])[..., 0][
                      y != IGNORE].mean() if x.shape[dim] > 1 else None)
          for dim, axis in ((1, "positions (dim=1)"), (0, "batch (dim=0)"))),
        Mistake("softmax_dim", "your log-softmax runs over the rows of the flattened logits (dim=0 of logits.reshape(-1, "
                               "V)), every position of every sequence, not over the vocabulary: each row's "
                               "probabilities are over its V tokens, log_softmax(flat, dim=-1).",
                output=lambda x, y: -x.reshape(-1, x.shape[-1]).log_softmax(0).gather(
                    1, y.reshape(-1, 1).clamp(min=0))[:, 0][y.reshape(-1) != IGNORE].mean()
                if x.shape[0] * x.shape[1] > 1 else None),
        Mistake("logits", "you return exp(loss), the perplexity; the loss is the mean cross-entropy itself, without "
                          "the exp.", output=lambda x, y: train_ref.lm_loss(x, y).exp()),
    ),
    each_case=True, dtype=False, finite=True, reword=_loss_error, diagnose=_smoothed_labels,
    # the text asks for new tensors on the logits' device; the batch probe does not fit a loss that reduces over the
    # batch (its mean mixes the sequences by design): a loss of one sequence alone is a mistake above
    probes=FunctionExercise.probes + ("device",),
    gradients=lambda: LM_LOSS.cases(),
    examples=lambda: _loss_cases(((1, 1, 2, 0), (1, 2, 3, 0), (2, 2, 3, 1)), 1, small=True),
    magnitude=lambda: [Case((x, targets), f"{case.what} with {how.replace('score', 'logit')}") for case in _loss_cases(
        ((2, 5, 7, 0), (3, 6, 11, 2)), 5) for logits, targets in (case.args,) for x, how in magnitude_rows(logits)],
    stability="A loss must hold for any logits: log(softmax(x)) underflows to log(0) = -inf when one logit is far "
              "above the others, and exp overflows for large ones. Pass the raw logits to F.cross_entropy (or use "
              "F.log_softmax, which subtracts each row's maximum).",
)


@checker("5.2", example=lambda fn, *_, **__: function_example(LM_LOSS)(_loss_of(fn)))
def check_lm_loss(fn: Callable[..., Any]) -> str:
    """fn(logits (N, L, V), targets (N, L)) -> mean cross-entropy, ignoring targets of -100."""
    expect_callable(fn, "lm_loss")
    return judge(LM_LOSS, _loss_of(fn))


# ---------------------------------------------------------------- 5.3 train_step

_LR = 0.1


class _StepCountingSGD(torch.optim.SGD):
    """The optimizer handed to the student: plain SGD that counts its steps, so that weights moved by hand (or by
    an optimizer train_step built itself) are told apart from a step of the one it was given."""

    steps_taken = 0

    def step(self, closure: Any = None) -> Any:
        self.steps_taken += 1
        return super().step(closure)


def _tiny_gpt(seed: int, **overrides: Any) -> nn.Module:
    torch.manual_seed(seed)
    return model_ref.GPT(model_ref.GPTConfig(**{**dict(vocab_size=11, max_tokens=8, embed_dim=16, num_heads=2,
                                                       num_layers=1, dropout_rate=0.0), **overrides}))


def _gradient(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Gradient (flat) and loss of the reference loss at the model's current weights (on a copy)."""
    clone = copy.deepcopy(model).train()
    clone.zero_grad(set_to_none=True)
    loss = train_ref.lm_loss(clone(inputs), targets)
    loss.backward()
    return _flat_grad(clone.parameters()), loss.item()


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _flat_grad(params: Any) -> torch.Tensor:
    return _flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    denominator = a.norm() * b.norm()
    return float((a @ b) / denominator) if denominator > 0 else 0.0


def _loss_value(result: Any, what: str) -> tuple[float, str]:
    value, note = None, ""
    if isinstance(result, torch.Tensor) and result.numel() == 1:
        if result.is_meta or result.is_complex():
            fail("dtype", f"{what} returned a {'meta' if result.is_meta else 'complex'} tensor, which is no loss "
                          f"value: return loss.item(), the float of the forward pass's loss.")
        if result.requires_grad:   # the text asks for a float: a loop that keeps these keeps every graph
            fail("dtype", f"{what} returned the loss tensor itself, which still holds the graph of the forward "
                          f"pass: a training loop that logs or adds up these losses keeps every step's graph in "
                          f"memory. Return loss.item(), the plain float.")
        value, note = float(result.detach().reshape(())), (" (You return a tensor; `loss.item()` gives the plain "
                                                           "float the training loop logs, without keeping the graph "
                                                           "alive.)")
    elif isinstance(result, numbers.Real) and not isinstance(result, bool):
        value = float(result)
    if value is not None:
        if not math.isfinite(value):   # never within a tolerance, whatever a comparison with it says
            fail("nan", f"{what} returned loss {value}: the loss of this batch is a finite number. Return "
                        f"loss.item() of the loss you called backward() on.")
        return value, note
    fail("dtype", f"{what} should return the loss as a float (loss.item()), but returned "
                  f"{'nothing (did you forget `return`?)' if result is None else type(result).__name__}.")
    return 0.0, ""


def _one_step(fn: Callable[..., Any], model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
              targets: torch.Tensor, what: str, **kwargs: Any) -> tuple[float, str, torch.Tensor, torch.Tensor, bool]:
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    steps_before = getattr(optimizer, "steps_taken", None)
    rates = [group.get("lr") for group in optimizer.param_groups]
    backward_ran = []
    handle = params[0].register_hook(lambda grad: backward_ran.append(True))
    try:
        with recording_calls(model) as calls:
            result = call(fn, model, optimizer, inputs, targets, what=what, **kwargs)
    except Failure as failure:
        if "does not require grad" in failure.message:   # torch's words for a loss with no graph behind it
            reraise_with(failure, "gradient", " Your loss has no path back to the weights: the forward ran under "
                         "torch.no_grad() (or the logits were detached). Run the model with gradients on, in "
                         "train_step itself.")
        raise
    finally:
        handle.remove()
    loss, note = _loss_value(result, what)
    now = [group.get("lr") for group in optimizer.param_groups]
    if now != rates:
        fail("kept_state", f"{what} changed the optimizer's learning rate from {rates[0]} to {now[0]}, so every later "
                           f"step is different: a schedule belongs to the training loop, and train_step leaves the "
                           f"optimizer's settings as it was given them.")
    delta = _flat([p.detach() - b for p, b in zip(params, before)])
    # model.forward(...) called directly bypasses the hook; then the mode it was left in must do
    in_training = all(c["training"] for c in calls) if calls else model.training
    if not float(delta.abs().max()) > 0:
        if not backward_ran:
            fail("step_order", f"{what}: the weights did not change and no gradient reached them: call "
                             f"loss.backward() before optimizer.step(), on the loss computed from the model's "
                             f"output (a loss rebuilt from loss.item(), or from detached logits, has no path back "
                             f"to the weights).")
        if bool(_flat_grad(params).abs().max() > 0):
            fail("step_order", f"{what}: gradients were computed but the weights did not change: call "
                             f"optimizer.step() after loss.backward().")
        fail("zero_grad", f"{what}: backward ran but the weights did not change, because the gradients were "
                          f"cleared before the step could use them. Order: zero_grad, forward, loss, backward, "
                          f"step.")
    if steps_before is not None and optimizer.steps_taken == steps_before:
        fail("step_order", f"{what}: the weights moved, but the optimizer you were given never stepped: call "
                           f"optimizer.step(). Updating the weights yourself, or with an optimizer train_step "
                           f"builds, skips what the given one does (AdamW's moments and weight decay, its "
                           f"learning-rate schedule).")
    return loss, note, delta, _flat_grad(params), in_training


def _stepped(step: Callable[..., Any]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One call of ``step`` on a fresh tiny GPT (in eval mode, as after an evaluation): the loss it returns and
    how far it moved the weights, side by side with the reference's."""
    @torch.enable_grad()   # the engine compares under no_grad; a training step needs its backward pass
    def run(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        model = _tiny_gpt(seed=0, vocab_size=5, max_tokens=4, embed_dim=4).eval()
        before = [p.detach().clone() for p in model.parameters()]
        loss = step(model, torch.optim.SGD(model.parameters(), lr=_LR), inputs, targets)
        moved = _flat([p.detach() - b for p, b in zip(model.parameters(), before)]).norm()
        return torch.stack([torch.as_tensor(float(loss), dtype=torch.float64), moved.double()])   # (2,)
    return run


def _step_cases() -> list[Case]:
    generator = torch.Generator().manual_seed(0)
    pairs = [torch.randint(0, 5, (2, 1, length), generator=generator) for length in (1, 2, 3)]
    return [Case((x, y), f"train_step on a tiny GPT (lr={_LR}): [the loss it returns, the size of the weight "
                         f"update]") for x, y in pairs]


_STEP_EXAMPLE = ProcedureExample(_stepped(lambda *args: train_ref.train_step(*args)), _step_cases,
                                 ("inputs", "targets"))


@checker("5.3", example=lambda fn, *_, **__: function_example(_STEP_EXAMPLE)(_stepped(fn)))
def check_train_step(fn: Callable[..., Any]) -> str:
    """fn(model, optimizer, inputs, targets) -> float: zero_grad, forward, loss, backward, (clip,) step."""
    expect_callable(fn, "train_step")
    model = _tiny_gpt(seed=3).eval()   # as after an evaluation: train_step must switch dropout back on
    optimizer = _StepCountingSGD(model.parameters(), lr=_LR)
    generator = torch.Generator().manual_seed(11)
    vocab = model.config.vocab_size
    # three batches of three shapes: a batch or a length written into the code shows
    batches = [(torch.randint(0, vocab, shape, generator=generator),
                torch.randint(0, vocab, shape, generator=generator)) for shape in ((3, 8), (2, 6), (4, 5))]
    batches[1][1][1, -3:] = IGNORE
    note, left_over, training = "", None, True
    for step, (inputs, targets) in enumerate(batches, start=1):
        what = f"train_step (step {step})"
        g, expected_loss = _gradient(model, inputs, targets)
        with recording_calls(model) as calls:
            loss, note_now, delta, left, in_training = _one_step(fn, model, optimizer, inputs, targets, what)
        note = note or note_now
        training = training and in_training
        if abs(loss - expected_loss) > 1e-4 * max(1.0, abs(expected_loss)):
            after = _gradient(model, inputs, targets)[1]   # the batch's loss at the weights the step left
            if abs(loss - after) <= 1e-4 * max(1.0, abs(after)):
                fail("step_order", f"{what} returned loss {loss:.5f}, the loss after the update; the loss of this "
                                   f"batch before the update is {expected_loss:.5f}. Return the loss you called "
                                   f"backward() on (loss.item() of the forward pass before optimizer.step()).")
            half = next((call["autocast"] for call in calls if call["autocast"] is not None), None)
            if half is not None:
                fail("precision", f"{what} returned loss {loss:.5f}; the loss of this batch before the update is "
                                  f"{expected_loss:.5f}: your model ran under torch.autocast with "
                                  f"{str(half).replace('torch.', '')}, so its matmuls rounded to half precision. Run "
                                  f"the step in the model's own dtype: mixed precision is a choice of the training "
                                  f"loop, not of this step.")
            fail("mismatch", f"{what} returned loss {loss:.5f}; the loss of this batch before the update is "
                             f"{expected_loss:.5f}. Return the lm_loss of the model's logits on these inputs "
                             f"and targets.")
        if _cosine(delta, -g) > 0.9999:
            ratio = float(delta.norm() / (_LR * g.norm()))
            # longer than the gradient step, which clipping never makes: a scaled gradient. One ending at norm
            # max_grad_norm (1.0 here) is a gradient rescaled up to it, or a scaled one clipped: the clipping
            # probes (max_grad_norm=None among them) tell which, with the scale itself
            if ratio > 1.01 and abs(ratio * float(g.norm()) - 1.0) > 0.01:
                _scaled_gradient(what, ratio, targets)
        elif left_over is not None and _cosine(delta, -(left_over + g)) > 0.9999:
            fail("zero_grad", f"{what}: the gradients of the previous step were still there: without "
                             f"optimizer.zero_grad() they accumulate, so each step also pushes in the direction "
                             f"of every earlier batch. Clear them at the start of every step.")
        else:
            _name_clipping(what, delta, g, model, 1.0)
            fail("mismatch", f"{what}: the weights moved, but not along the gradient of this batch's loss: "
                             f"something between the loss and the step turned it. Backpropagate "
                             f"lm_loss(model(inputs), targets) once, clip all the parameters together with one "
                             f"clip_grad_norm_(model.parameters(), max_grad_norm) (each parameter on its own, or "
                             f"by value, turns the direction), then call optimizer.step() once.")
        left_over = left
    if not training:
        fail("dropout", "Your train_step runs the model in eval mode, so dropout is off during training. Call "
                        "model.train() at the start (an evaluation before may have switched it to eval).")
    _check_clipping(fn, model, optimizer, batches[0], batches[2])
    _check_gradients_found(fn, batches[0])
    _check_step_float64(fn)
    _check_new_dropout_masks(fn)
    return ("Forward, loss, backward and step on gradients of this batch alone (cleared before its backward), "
            "clipped as asked; the loss comes back as a number." + note)


def _check_gradients_found(fn: Callable[..., Any], batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Step 1 of the text: gradients already on the model when train_step is called (an earlier backward, an
    evaluation that called it) are cleared before this batch's backward. A step that clears them only at its end
    passes a loop of its own steps, and adds those gradients into the first step after anything else."""
    inputs, targets = batch
    model = _tiny_gpt(seed=9)
    generator = torch.Generator().manual_seed(21)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)
    found = _flat_grad(model.parameters()).clone()
    g, _ = _gradient(model, inputs, targets)
    what = "train_step on a model that already holds gradients (an earlier backward's), max_grad_norm=None"
    _, _, delta, _, _ = _one_step(fn, model, torch.optim.SGD(model.parameters(), lr=_LR), inputs, targets, what,
                                  max_grad_norm=None)
    if _cosine(delta, -g) <= 0.9999 and _cosine(delta, -(g + found)) > 0.9999:
        fail("zero_grad", f"{what}: your step added the gradients the model already held to this batch's. "
                          f"PyTorch adds new gradients to old ones: call optimizer.zero_grad() at the START of "
                          f"train_step, before loss.backward(), not only at its end.")


def _scaled_gradient(what: str, ratio: float, targets: torch.Tensor, clipped: str = "") -> None:
    """Fail on an update along the batch's gradient but ``ratio`` times its SGD step, with nothing clipped: a
    multiple of the loss backpropagated (or backward, or the step, repeated; or the gradients multiplied).
    ``clipped`` says how a clipped step showed it."""
    _summed_loss(what, ratio, targets)
    if ratio > 1 and abs(ratio - round(ratio)) <= 0.01 * ratio:   # a whole number of gradient steps
        how = (f"did you call loss.backward() (or optimizer.step()) more than once ({round(ratio)} times), or "
               f"backpropagate a multiple of the loss ({round(ratio)} * loss)?")
    else:
        how = (f"you backpropagate a multiple of the loss, {ratio:.3g} * loss ("
               + ("a loss divided for gradient accumulation or by the batch size, " if ratio < 1 else "")
               + "or the gradients multiplied before the step).")
    fail("step_order", f"{what}: the update is {ratio:.2f} times the gradient step of the batch's mean loss, with "
                       f"nothing to clip: {how} train_step makes one update from one batch: backpropagate "
                       f"lm_loss(model(inputs), targets) itself, once, and let only the clipping change the "
                       f"gradient.{clipped}")


def _summed_loss(what: str, ratio: float, targets: torch.Tensor) -> None:
    """An update as many times the mean loss's step as there are target tokens: the loss was summed."""
    count = int((targets != IGNORE).sum())
    if abs(ratio - count) <= 0.01 * count:
        fail("loss_reduction", f"{what}: the update is {ratio:.2f} times the gradient step of the batch's mean "
                               f"loss, and the batch has {count} target tokens: you backpropagate the SUM of the "
                               f"token losses. Backpropagate their mean (lm_loss, or reduction='mean'), the loss "
                               f"you return.")


def _check_clipping(fn: Callable[..., Any], model: nn.Module, optimizer: torch.optim.Optimizer,
                    batch: tuple[torch.Tensor, torch.Tensor], other: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Step 5 of the spec: the gradient norm is clipped to ``max_grad_norm``, after backward; None clips nothing.
    ``other``, a batch whose gradient has another norm, tells a scaled gradient from one clipped to a fixed norm."""
    if not accepts(fn, "max_grad_norm"):
        fail("clipping", "Your train_step has no `max_grad_norm` parameter: keep the given signature "
                         "`train_step(model, optimizer, inputs, targets, max_grad_norm=1.0)` and clip the gradient "
                         "norm to it.")
    inputs, targets = batch

    def stepped(fraction: float | None, limit_of: Callable[[torch.Tensor], float] | None = None,
                on: tuple[torch.Tensor, torch.Tensor] = batch
                ) -> tuple[str, torch.Tensor, float, float | None, torch.Tensor]:
        """One step (on ``batch`` unless told) with max_grad_norm at ``fraction`` of the gradient's norm (or
        ``limit_of(gradient)``): what was called, the gradient, the update as a multiple of the whole gradient step
        (1 when nothing was clipped), the limit, and the update."""
        inputs, targets = on
        g = _gradient(model, inputs, targets)[0]
        limit = None if fraction is None else fraction * float(g.norm()) if limit_of is None else limit_of(g)
        what = f"train_step(..., max_grad_norm={'None' if limit is None else f'{limit:.3g}'})"
        try:
            _, _, delta, _, _ = _one_step(fn, model, optimizer, inputs, targets, what, max_grad_norm=limit)
        except Failure as failure:
            if limit is None and failure.diagnosis == "exception":
                fail("clipping", extend(failure.message, "max_grad_norm=None means: do not clip (the exercise's "
                                        "step 5). Clip only `if max_grad_norm is not None`."))
            raise
        return what, g, float(delta.norm() / (_LR * g.norm())), limit, delta

    def scaled_by(factor: float, g: torch.Tensor, delta: torch.Tensor) -> str | None:
        """Is an unclipped step ``factor`` times the gradient step (``g``, the update ``delta``) a scaled gradient?
        On the other batch, whose gradient has another norm, a gradient clipped to a fixed norm (max_grad_norm
        ignored) keeps the update's norm; a scaled one is scaled there too. None if not, else what to add."""
        if abs(factor - 1.0) <= 0.01 or _cosine(delta, -g) <= 0.9999:
            return None
        try:
            _, g_other, factor_other, _, delta_other = stepped(None, on=other)
        except Failure:
            return None
        fixed_norm = factor * float(g.norm()) / float(g_other.norm())   # the factor a fixed norm gives there
        if (abs(fixed_norm / factor - 1.0) <= 0.03 or abs(factor_other - fixed_norm) <= 0.01 * fixed_norm
                or abs(factor_other - 1.0) <= 0.01 or _cosine(delta_other, -g_other) <= 0.9999):
            return None
        if abs(factor_other - factor) <= 0.01 * factor:
            return ""
        sizes = (len(batch[0]), len(other[0]))
        by_size = all(abs(f * n - 1.0) <= 0.01 for f, n in zip((factor, factor_other), sizes))
        return (f" Your factor changes with the batch: {factor:.3g} on {sizes[0]} sequences, {factor_other:.3g} on "
                + (f"{sizes[1]}: you divide the loss by the batch size, but lm_loss is already the mean over "
                   f"every target token." if by_size else f"{sizes[1]}."))

    def scaled_then_clipped(limit: float, ratio: float, fraction: float, expected: float) -> None:
        """A step that misses the clipped one at ``fraction`` of the norm, because the gradient was scaled (a
        multiple of the loss; clipped after, or before, the scale): with nothing to clip its factor shows."""
        try:
            what_none, g_none, factor, _, delta_none = stepped(None)
        except Failure:   # max_grad_norm=None itself goes wrong: judged below, in its turn
            return
        if not any(abs(ratio - scaled) <= 0.01 * scaled for scaled in (min(factor, fraction),
                                                                        factor * min(1.0, fraction))):
            return
        note = scaled_by(factor, g_none, delta_none)
        if note is not None:
            _scaled_gradient(what_none, factor, targets,
                             f"{note} (With max_grad_norm={limit:.3g} the step was {ratio:.2f} times the "
                             f"gradient step where clipping gives {expected:.2f}: the scale made it, not the "
                             f"clipping.)")

    # a limit below the norm, none, one above it (nothing to clip: a rescale to max_grad_norm shows; after None,
    # which tells a gradient scaled by the loss, clipped down to the limit, from one rescaled up to it)
    for fraction in (0.3, None, 2.0):
        what, g, ratio, limit, delta = stepped(fraction)
        expected = 1.0 if fraction is None or fraction >= 1 else fraction
        if abs(ratio - expected) <= 0.01 * expected:
            continue
        if fraction is not None:
            scaled_then_clipped(limit, ratio, fraction, expected)   # a scaled gradient is no clipping mistake
            _name_clipping(what, delta, g, model, limit)
        if limit is not None and abs(ratio - 1.0) <= 0.01:
            # nothing clipped at 0.3 of the norm: clipped each value, or measured by the mean? A limit below the
            # typical entry of the gradient clips those too.
            what_small, g_small, _, limit_small, delta_small = stepped(1.0, lambda g: 0.5 * float(g.abs().mean()))
            _name_clipping(what_small, delta_small, g_small, model, limit_small)
        if fraction is None:
            _summed_loss(what, ratio, targets)
            clipped_to = ratio * float(g.norm())              # the update's gradient norm
            if ratio > 1.0 or abs(clipped_to - 1.0) > 0.01:   # no clipping makes a step longer, or ends at norm 1
                note = scaled_by(ratio, g, delta)             # scaled on another batch too, not clipped
                if note is not None:
                    _scaled_gradient(what, ratio, targets, f"{note} (With a max_grad_norm, clipping hid it.)")
                fail("mismatch", f"{what}: the update is {ratio:.2f} times the gradient step of the batch's mean "
                                 f"loss, with nothing to clip: your gradient is scaled or changed before the "
                                 f"step (a multiple of the loss, gradients clipped or changed by hand). "
                                 f"Backpropagate lm_loss itself, once, and step on that gradient, clipped only "
                                 f"when max_grad_norm is not None.")
            fail("clipping", f"{what}: with max_grad_norm=None the step should use the whole gradient, but it "
                             f"was {ratio:.2f} times as long. Clip only `if max_grad_norm is not None`.")
        if abs(ratio - 1.0) <= 0.01:
            fail("clipping", f"{what}: the gradient (norm {float(g.norm()):.3g}) was not clipped. Call "
                             f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm) after "
                             f"loss.backward() and before optimizer.step(): before backward there is nothing "
                             f"to clip yet.")
        clipped_to = ratio * float(g.norm())                 # the norm the update's gradient had
        _, g_again, ratio_again, limit_again, _ = stepped(2 * fraction)   # does that norm follow max_grad_norm?
        if abs(ratio_again * float(g_again.norm()) - clipped_to) <= 0.01 * clipped_to:
            fail("clipping", f"train_step clipped the gradient to norm {clipped_to:.3g} with max_grad_norm="
                             f"{limit:.3g} and again with max_grad_norm={limit_again:.3g}: a fixed number. Clip to "
                             f"the argument, clip_grad_norm_(model.parameters(), max_grad_norm).")
        fail("clipping", f"{what}: the step was {ratio:.2f} times the gradient step, expected {expected:.2f}: the "
                         f"gradient's norm over all the parameters together, clipped to max_grad_norm. Clip with "
                         f"one torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm) after backward, "
                         f"with its default L2 norm.")


def _clippings(g: torch.Tensor, sizes: list[int], limit: float) -> dict[str, torch.Tensor]:
    """The gradient ``g`` (flat, parameters of ``sizes`` one after the other) as each way of clipping it to
    ``limit`` that is not one global L2 norm scaled down would leave it."""
    norm = float(g.norm())
    parts = g.split(sizes)

    def scaled(total: float, always: bool = False) -> torch.Tensor:
        return g * (limit / total if always or total > limit else 1.0) if total > 0 else g
    return {
        "value": g.clamp(-limit, limit),
        "parameter": torch.cat([p * min(1.0, limit / float(p.norm())) if float(p.norm()) > 0 else p for p in parts]),
        "squared": scaled(norm ** 2),
        "mean": scaled(float(g.abs().mean())),
        "rms": scaled(float(g.pow(2).mean().sqrt())),
        "inf": scaled(float(g.abs().max())),       # clip_grad_norm_(..., norm_type=float("inf")): the largest entry
        "l1": scaled(float(g.abs().sum())),        # norm_type=1: the sum of absolute values
        "always": scaled(norm, always=True),
    }


def _name_clipping(what: str, delta: torch.Tensor, g: torch.Tensor, model: nn.Module, limit: float) -> None:
    """Fail, naming it, when the update ``delta`` is the SGD step of ``g`` clipped to ``limit`` in a way other than
    one global norm: by value, each parameter on its own, the norm squared, the mean, or always rescaled."""
    right = g * min(1.0, limit / float(g.norm()))
    sizes = [p.numel() for p in model.parameters()]
    if delta.numel() != g.numel() or sum(sizes) != g.numel():
        return
    for name, clipped in _clippings(g, sizes, limit).items():
        expected = -_LR * clipped
        close = float((delta - expected).norm()) <= 1e-3 * max(float(expected.norm()), 1e-12)
        # the same as the right one, or as no clipping at all (nothing above the limit): it tells nothing apart
        if not close or any(float((expected + _LR * same).norm()) <= 1e-3 * float((_LR * same).norm())
                            for same in (right, g)):
            continue
        how = "torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm) after loss.backward()"
        if name == "value":
            fail("clipping", f"{what}: your code clips each value of the gradient to [-{limit:.3g}, {limit:.3g}] "
                             f"(clip_grad_value_, or clamp) instead of scaling the whole gradient down by its global "
                             f"norm: clipping each value turns the gradient's direction. Use {how}.")
        if name == "parameter":
            fail("mismatch", f"{what}: your code clips each parameter on its own, by its own gradient norm, "
                             f"instead of all of them together by the global norm (the norm of every gradient "
                             f"together): that turns the gradient's direction. Use one {how}.")
        if name == "squared":
            fail("clipping", f"{what}: your code scales the gradient by max_grad_norm over its norm squared (the sum "
                             f"of squares, without its square root): the norm is the square root of that sum. "
                             f"Use {how}.")
        if name in ("inf", "l1"):
            measure = ("its largest absolute entry (norm_type=inf)" if name == "inf" else
                       "its L1 norm, the sum of absolute values (norm_type=1)")
            fail("clipping", f"{what}: your code measures the gradient by {measure} instead of its L2 norm, the "
                             f"square root of the sum of squares over all the parameters together (clip_grad_norm_'s "
                             f"default norm_type=2). Use {how}.")
        if name in ("mean", "rms"):
            fail("clipping", f"{what}: your code measures the gradient by the mean of its entries "
                             f"({'of their absolute values' if name == 'mean' else 'the root mean square'}) instead "
                             f"of its norm, the square root of the sum of squares over all the parameters "
                             f"together. Use {how}.")
        fail("clipping", f"{what}: your code rescales the gradient to norm max_grad_norm={limit:.3g} even when its "
                         f"norm ({float(g.norm()):.3g}) is below max_grad_norm, which makes the step longer: clipping "
                         f"only scales a gradient down, by min(1, max_grad_norm / norm). Use {how}.")


_DROPOUT = 0.5   # the dropout rate of the model where the masks each step draws are compared


def _check_new_dropout_masks(fn: Callable[..., Any]) -> None:
    """``dropout``: every step must draw new dropout masks from the caller's generator. One step on a model with
    dropout on, from two random states and the first again (each on a fresh model): a step that seeds torch's
    generator itself (or puts back a state it saved) returns the same loss from both, or another loss from the
    same state where its seed changes from call to call; one that puts the caller's state back after it (fork_rng) leaves the generator
    where it found it, so the next step draws the same masks. Torch's random state is the caller's again after."""
    generator = torch.Generator().manual_seed(17)
    inputs, targets = (torch.randint(0, 11, (2, 8), generator=generator) for _ in range(2))
    what = f"train_step on a tiny GPT with dropout_rate={_DROPOUT}"

    def step(run: Callable[..., Any], seed: int) -> tuple[float, bool]:
        model = _tiny_gpt(seed=7, dropout_rate=_DROPOUT)
        optimizer = torch.optim.SGD(model.parameters(), lr=_LR)
        torch.manual_seed(seed)
        before = torch.get_rng_state()
        loss = run(model, optimizer, inputs, targets)
        return loss, bool(torch.equal(torch.get_rng_state(), before))

    with torch.random.fork_rng(devices=[]):
        reference = [step(lambda *args: train_ref.train_step(*args), seed) for seed in (1, 2)]
        if reference[0][0] == reference[1][0] or reference[0][1]:
            return   # no mask drawn here: nothing to compare
        (first, kept), (second, _), (again, _) = [
            step(lambda *args: _loss_value(call(fn, *args, what=what), what)[0], seed) for seed in (1, 2, 1)]
    if first == second:
        fail("dropout", f"{what}, started from two different random states, returned the same loss ({first:.5f}) "
                        f"both times: your train_step seeds torch's generator itself (a torch.manual_seed(...), or a "
                        f"saved state put back with set_rng_state, inside it), so every step draws the same dropout "
                        f"masks. train_step must not seed the generator: seed once, before training.")
    if first != again:
        fail("dropout", f"{what}, started twice from the same random state, returned two different losses ({first:.5f} "
                        f"and {again:.5f}): your train_step seeds torch's generator itself, with a seed that changes "
                        f"(a step counter, torch.seed(), the time), so the masks it draws are not the ones the "
                        f"caller's seed gives and a run cannot be repeated. train_step must not seed the generator: "
                        f"seed once, before training.")
    if kept:
        fail("dropout", f"{what}: your train_step leaves torch's random state exactly as it found it (a "
                        f"torch.random.fork_rng() or get_rng_state/set_rng_state around the step), so the next step "
                        f"draws the same dropout masks again. Let the step's draws move the generator on: seed once, "
                        f"before training, and nowhere in train_step.")


def _check_step_float64(fn: Callable[..., Any]) -> None:
    """The dtype probe: a float64 model in a float64 notebook. The step must run, return the batch's loss, move
    the weights along its gradient, and leave the model in float64 (``model.float()`` inside is ``dtype``)."""
    what = f"train_step on a float64 model {IN_FLOAT64}"

    def run() -> tuple[torch.Tensor, float, float, torch.Tensor]:
        model = _tiny_gpt(seed=5)
        optimizer = _StepCountingSGD(model.parameters(), lr=_LR)
        generator = torch.Generator().manual_seed(13)
        vocab = model.config.vocab_size
        inputs, targets = (torch.randint(0, vocab, (3, 8), generator=generator) for _ in range(2))
        g, expected_loss = _gradient(model, inputs, targets)
        loss, _, delta, _, _ = _one_step(fn, model, optimizer, inputs, targets, what)
        expect_dtype_kept(model, torch.float64, what)
        return g, expected_loss, loss, delta
    g, expected_loss, loss, delta = run_in_float64(run)
    if abs(loss - expected_loss) > 1e-4 * max(1.0, abs(expected_loss)) or _cosine(delta, -g) <= 0.9999:
        fail("precision", f"{what}: the loss ({loss:.6f}, expected {expected_loss:.6f}) or the update differs from "
                          f"the reference's, which float64 does not explain: part of your step runs in a lower "
                          f"precision (a .float(), a float32 constant tensor). Keep the model's dtype throughout.")


# two different rows, so that a batch mixes distributions; no ties anywhere
_BASE = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0],
                      [-1.0, 0.0, 2.5, 0.5, 1.0, -0.5]])
_REPEATS = 2500     # draws per row: a frequency's standard deviation is at most 0.01
_TOLERANCE = 0.045  # 4.5 standard deviations: a correct sampler fails by chance about once in 2000 checks


# a sampler's result that holds the logits' values, not their positions (floats where ids are asked)
_NOT_IDS = tuple(Mistake("dtype", f"you return the {said}, not their positions: a token id is the index of the "
                                  f"chosen entry in the vocabulary, logits.argmax(-1) (or .max(-1).indices), and the "
                                  f"index torch.multinomial returns.", output=output)
                 for said, output in (("largest logits themselves",
                                       lambda logits, temperature: logits.max(-1).values),
                                      ("largest logits divided by the temperature",
                                       lambda logits, temperature: (logits / temperature).max(-1).values),
                                      ("largest probabilities",
                                       lambda logits, temperature: (logits / temperature).softmax(-1).max(-1).values)))


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
        _top_k_for_one_row(fn, logits, text, **kwargs)
        raise
    if isinstance(result, torch.Tensor) and result.shape == (logits.shape[0], 1):
        greedy = kwargs.get("temperature") == 0   # only argmax runs there: the axis comes from its keepdim
        kept = ("argmax(-1, keepdim=True), max(-1, keepdim=True) or topk(1) on the greedy path keeps" if greedy else
                "torch.multinomial(probs, 1) keeps a last dimension of size 1, and so do argmax and max with "
                "keepdim=True (on the greedy path, or a top-k threshold's path); each keeps")
        fail("shape", f"{what} returned shape {tuple(result.shape)}; expected ({logits.shape[0]},), one token id "
                      f"per row. {kept} a last dimension of size 1: squeeze it, .squeeze(-1) (or [:, 0]), on every "
                      f"path that returns ids.")
    if isinstance(result, torch.Tensor) and result.dim() == 0 and logits.shape[0] == 1:
        fail("shape", f"{what} returned a single number of shape (); expected (1,), one token id per row even "
                      f"for a batch of one. `.squeeze()` drops every axis of size 1, the batch too: use "
                      f".squeeze(-1) (or [:, 0]).")
    expect_tensor(result, (logits.shape[0],), what)
    if result.is_floating_point():
        temperature = kwargs.get("temperature") or 1.0
        first_mistake(_NOT_IDS, lambda mistake: bool(torch.equal(result, mistake.output(logits, temperature)
                                                                  .to(result.dtype))), f"{what}: ")
    if result.is_floating_point() or result.dtype == torch.bool:
        fail("dtype", f"{what} returned dtype {result.dtype}; token ids are integers (torch.long).")
    if result.dtype != torch.long:
        fail("dtype", f"{what} returned dtype {result.dtype}; return torch.long token ids, as argmax and "
                      f"multinomial do.")
    if bool((result < 0).any()) or bool((result >= logits.shape[1]).any()):
        fail("mismatch", f"{what} returned ids outside 0 .. {logits.shape[1] - 1}; the id of a token is its "
                         f"column in the logits.")
    return result


def _runs(fn: Callable[..., Any], logits: torch.Tensor, **kwargs: Any) -> bool:
    try:
        call(fn, logits.clone(), what="sample_next_token", **kwargs)
    except Failure:
        return False
    return True


def _top_k_for_one_row(fn: Callable[..., Any], logits: torch.Tensor, text: str, **kwargs: Any) -> None:
    """``top_k`` where the call with top_k raised on a batch but runs on its first row alone, and on the batch
    without top_k: the k-th largest logit (or the mask) of each row lost its axis, (N,) where (N, 1) lines up with
    the rows (values[:, -1], a min or kthvalue without keepdim=True), so it meets the vocabulary axis instead."""
    if kwargs.get("top_k") is None or logits.shape[0] == 1:
        return
    without = {name: value for name, value in kwargs.items() if name != "top_k"}
    if _runs(fn, logits[:1], **kwargs) and _runs(fn, logits, **without):
        fail("top_k", extend(text, f"It runs on one row, and on these {logits.shape[0]} rows without top_k: your "
                                   f"top-k threshold has lost the row axis. The k-th largest logit of each row, "
                                   f"topk(...).values[:, -1], has shape (N,), which lines up with the vocabulary "
                                   f"(the last axis of the logits), not with the rows. Keep the axis: "
                                   f"values[:, -1:] (or keepdim=True), shape (N, 1), one threshold per row."))


def _frequencies(draws: torch.Tensor, rows: int, vocab: int) -> torch.Tensor:
    per_row = draws.long().flatten().view(-1, rows).T                   # (rows, repeats)
    return torch.stack([torch.bincount(r, minlength=vocab).double() / per_row.shape[1] for r in per_row])


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


def _drawn_from(freq: torch.Tensor, probs: torch.Tensor | None) -> bool:
    return probs is not None and _matches(freq, probs) and not bool((freq[probs == 0] > 0).any())


def _permuted(freq: torch.Tensor, probs: torch.Tensor) -> bool:
    """The draws follow each row's probabilities in another order (and not in the right one)."""
    return _matches(freq.sort(-1).values, probs.sort(-1).values) and not _matches(freq, probs)


def _describe(freq: torch.Tensor, probs: torch.Tensor) -> str:
    row, token = divmod(int((freq - probs).abs().argmax()), probs.shape[1])
    return (f"token {token} of row {row} came up {freq[row, token]:.1%} of the time; it should be "
            f"{probs[row, token]:.1%}")


def _over_batch(base: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    exps = (base / temperature).double().exp()
    over_batch = exps / exps.sum(0)                                      # each token normalised over the rows
    return over_batch / over_batch.sum(-1, keepdim=True)


def _top_k_mistake(code: str, message: str, make: Callable[..., torch.Tensor]) -> Mistake:
    return Mistake(code, message, output=lambda base, temperature, top_k:
                   make(base, temperature, top_k) if top_k is not None and 1 <= top_k <= base.shape[1] else None)


# What a wrong sampler draws from, as the distribution its frequencies follow (None where it does not apply);
# its message may name {setting}, {top_k}, {fewer} and {more} (top_k - 1 and top_k + 1).
_SAMPLING_MISTAKES = (
    Mistake("greedy", "you always return the most likely token, so there is no randomness. At {setting} draw from "
                      "the distribution (torch.multinomial on the probabilities); only temperature=0 means argmax.",
            output=lambda base, t, k: F.one_hot(base.argmax(-1), base.shape[1]).double()),
    Mistake("normalization", "you sample in proportion to the raw logits. Logits are not probabilities: apply a "
                             "softmax over the vocabulary first.",
            output=lambda base, t, k: base.double() / base.double().sum(-1, keepdim=True) if bool((base > 0).all())
            else None),
    *(Mistake("softmax_dim", "the softmax runs over the batch (dim 0), not over the vocabulary; normalise each row, "
                             "dim=-1.", output=output)
      for output in (_over_batch, lambda base, t, k: torch.full(base.shape, 1.0 / base.shape[1], dtype=torch.float64))),
    Mistake("scale", "you multiply the logits by the temperature; divide them by it, so that a low temperature "
                     "sharpens the distribution and a high one flattens it.",
            output=lambda base, t, k: _probabilities(base * t, k) if t != 1 else None),
    Mistake("scale", "at {setting} the temperature has no effect. Divide the logits by it before the softmax, on "
                     "every path (with and without top_k), not the probabilities (dividing them changes nothing "
                     "once they are renormalised).",
            output=lambda base, t, k: _probabilities(base, k) if t != 1 else None),
    Mistake("scale", "at {setting} the logits are divided by the temperature twice (by its square): divide them once, "
                     "before the softmax, on every path (a division before the top-k branch and another in it "
                     "counts twice).",
            output=lambda base, t, k: _probabilities(base / (t * t), k) if t != 1 else None),
    *(_top_k_mistake("top_k", f"you keep {{{name}}} tokens instead of top_k={{top_k}} (off by one in the threshold: "
                              f"keep the logits >= the k-th largest).",
                     lambda base, t, k, step=step: _probabilities(base / t, k + step) if 1 <= k + step <= base.shape[1]
                     else None)
      for name, step in (("fewer", -1), ("more", 1))),
    _top_k_mistake("top_k", "top_k has no effect: tokens outside the {top_k} most likely are still drawn. Set the "
                            "other logits to -inf before the softmax.",
                   lambda base, t, k: _probabilities(base / t)),
    _top_k_mistake("top_k", "the tokens outside the top {top_k} are still drawn sometimes: you set their logits to "
                            "0, which is still a fair chance. Use -inf, which gives exactly zero probability.",
                   lambda base, t, k: _probabilities(base / t, k, fill=0.0)),
    _top_k_mistake("top_k", "you keep the {top_k} LEAST likely tokens; keep the most likely ones (topk returns the "
                            "largest values first).",
                   lambda base, t, k: _probabilities(base / t, k, smallest=True)),
    # the right probabilities on the wrong tokens: a position in a reordered vocabulary returned as the token id
    *(Mistake("mismatch", f"your draws follow the probabilities {order}: you return the position in the sorted "
                          f"order{first}, not the token id. Map it back to the token id with the sort's indices, "
                          f"indices.gather(-1, position) (with topk, its .indices).",
              output=lambda base, t, k, descending=descending: _probabilities(base / t, k).sort(
                  -1, descending=descending).values)
      for order, first, descending in (("sorted from the largest (sort(descending=True), or topk)",
                                        " (0 for the most likely token)", True),
                                       ("sorted from the smallest (sort's default order)",
                                        " (the last for the most likely token)", False))),
    Mistake("mismatch", "your draws follow the probabilities in reversed order: token V - 1 - i comes up as often as "
                        "token i should. You reverse the vocabulary (flip) and return the position in the reversed "
                        "order, not the token id: map it back, V - 1 - position (or flip back).",
            output=lambda base, t, k: _probabilities(base / t, k).flip(-1)),
)


def _check_distribution(fn: Callable[..., Any], base: torch.Tensor, temperature: float,
                        top_k: int | None) -> None:
    logits = base.repeat(_REPEATS, 1)                                  # (2 * repeats, vocab)
    kwargs = {"temperature": temperature, **({} if top_k is None else {"top_k": top_k})}
    setting = f"temperature={temperature}" + (f", top_k={top_k}" if top_k is not None else "")
    what = f"sample_next_token({setting}) on {logits.shape[0]} rows"
    draws = _draw(fn, logits, what, **kwargs)
    freq = _frequencies(draws, base.shape[0], logits.shape[1])   # (2, vocab)
    expected = _probabilities(base / temperature, top_k)
    if _matches(freq, expected):
        return
    _one_draw_for_all_rows(fn, logits, base.shape[0], what, kwargs, draws)
    # a token drawn where the mistake gives it no chance rules the mistake out (2500 draws a row: every token
    # of probability >= 0.5% shows up), which tells k + 1 kept tokens from no top_k at all
    first_mistake(_SAMPLING_MISTAKES, lambda m: _drawn_from(freq, m.output(base, temperature, top_k)), f"{what}: ",
                  setting=setting, top_k=top_k, fewer=(top_k or 0) - 1, more=(top_k or 0) + 1)
    if _permuted(freq, expected):
        fail("mismatch", f"{what}: your draws have the right probabilities but on the wrong tokens: "
                         f"{_describe(freq, expected)}, while the probabilities of each row, in any order, are "
                         f"right. You return a position in a reordered vocabulary (after a sort, topk, flip or "
                         f"shuffle), not the token id: map the position back to the token id with the same indices "
                         f"(indices.gather(-1, position)).")
    if top_k is not None and bool((freq[expected == 0] > 0).any()):
        fail("top_k", f"{what}: tokens outside the {top_k} most likely were drawn. With top_k, only the k highest "
                      f"logits may be drawn.")
    fail("mismatch", f"{what}: the draws do not follow softmax(logits / temperature): {_describe(freq, expected)}.")


def _one_draw_for_all_rows(fn: Callable[..., Any], logits: torch.Tensor, rows: int, what: str,
                           kwargs: dict[str, Any], draws: torch.Tensor) -> None:
    """Every copy of a row got the same token in one call, and the calls differ: one draw serves the batch
    (which, when it lands on the most likely token, looks greedy within one call)."""
    first = draws.long().flatten().view(-1, rows)                        # (repeats, rows)
    if not bool((first == first[0]).all()):
        return
    again = [_draw(fn, logits, what, **kwargs).long().flatten().view(-1, rows)[0] for _ in range(4)]
    if any(not torch.equal(tokens, first[0]) for tokens in again):
        fail("mismatch", f"{what}: within one call every copy of a row got the same token, and other calls gave "
                         f"other tokens: one random draw serves the whole batch (one torch.rand for every row, or "
                         f"one sample repeated). Draw one token per row: torch.multinomial(probs, num_samples=1) "
                         f"samples each row on its own.")


def _check_generator_is_used(fn: Callable[..., Any], logits: torch.Tensor, **options: Any) -> None:
    """With a generator, the draws come from it: its state advances and the global RNG is left alone; and two
    generators seeded alike give the same tokens whatever the global state (``options``: top_k on every path)."""
    shown = "".join(f"{name}={value}, " for name, value in options.items())
    what = f"sample_next_token({shown}generator=...)"
    runs = []
    for seed in (1, 2):
        torch.manual_seed(seed)   # a different global state each time: only the generator may decide
        runs.append(_draw(fn, logits, what, generator=torch.Generator().manual_seed(1234), **options))
    generator = torch.Generator().manual_seed(99)
    before_generator, before_global = generator.get_state(), torch.get_rng_state()
    _draw(fn, logits, what, generator=generator, **options)
    if not torch.equal(torch.get_rng_state(), before_global):
        fail("generator", f"{what} used (or reseeded) the global random state although a generator was given: "
                          f"draw with it, torch.multinomial(probs, 1, generator=generator), and never call "
                          f"torch.manual_seed inside the sampler.")
    if torch.equal(generator.get_state(), before_generator):
        fail("generator", f"{what} never drew from the generator it was given: pass it on, "
                          f"torch.multinomial(probs, 1, generator=generator).")
    if not torch.equal(runs[0], runs[1]):
        fail("mismatch", f"{what}: two calls with generators seeded the same gave different tokens: pass "
                         f"`generator` on to the random function you use (torch.multinomial(..., "
                         f"generator=generator)), so that results can be reproduced.")


def _check_global_state_without_generator(fn: Callable[..., Any]) -> None:
    """With ``generator=None`` the draws come from torch's global random state: the notebook's torch.manual_seed
    decides them. A new torch.Generator() made in each call, or a seed set inside, draws the same tokens whatever
    that state."""
    what = "sample_next_token(logits) with no generator"
    runs = []
    for seed in (1, 2, 1):
        torch.manual_seed(seed)
        runs.append(_draw(fn, _BASE.repeat(20, 1), what))                                 # (40,)
    ignored = torch.equal(runs[0], runs[1])   # seeds 1 and 2 alike: a generator made (or seeded) in each call
    if ignored or not torch.equal(runs[0], runs[2]):   # seed 1 twice unlike: a random state of its own
        why = ("the notebook's torch.manual_seed(1) and torch.manual_seed(2) gave the same 40 tokens, so your draws "
               "ignore torch's global random state (a new torch.Generator() made in each call, or a seed set inside "
               "your function: every call then draws alike)" if ignored else
               "torch.manual_seed(1) twice gave different tokens, so your draws come from a random state of your own "
               "(a generator kept outside the function), not the global one the notebook seeds")
        fail("generator", f"{what}: {why}. With generator=None, pass None on: torch.multinomial(probs, 1, "
                          f"generator=None) draws from torch's global random state, which the notebook's "
                          f"torch.manual_seed sets.")


def _check_top_k_per_row(fn: Callable[..., Any]) -> None:
    """top_k keeps the k largest logits OF EACH ROW: rows of very different scales show a threshold taken
    over the whole batch (each row alone is fine, together they are not)."""
    rows = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0],
                         [-5.0, -4.0, -3.0, -2.0, -1.0, 0.0]])
    allowed = _probabilities(rows, 2) > 0                              # (2, 6): tokens 0, 1 and 4, 5
    repeats = 200
    what = "sample_next_token(top_k=2) on rows of different scales"

    def kept_top_2(logits: torch.Tensor, row: torch.Tensor) -> bool:
        """Were only each row's own top 2 tokens drawn? ``row`` says which of ``rows`` each line is."""
        try:
            draws = as_tensor(call(fn, logits.clone(), top_k=2, what=what))
        except Failure:
            return False
        if not isinstance(draws, torch.Tensor) or draws.shape != row.shape or draws.is_floating_point():
            return False
        return bool(allowed[row, draws.long().clamp(0, 5)].all())

    mixed = torch.arange(2).repeat(repeats)                            # (400,): 0, 1, 0, 1, ...
    if kept_top_2(rows[mixed], mixed):
        return
    if all(kept_top_2(rows[i:i + 1].repeat(repeats, 1), torch.full((repeats,), i)) for i in range(2)):
        fail("batch_mixing", f"{what}: each row alone keeps its own top 2 tokens, but in a batch the rows change "
                             f"each other's result: you take the k-th largest logit over the whole batch. Take it "
                             f"per row, logits.topk(top_k, dim=-1).values[:, -1:] (shape (N, 1)), and compare "
                             f"each row with its own threshold.")


def _check_sampling_magnitude(fn: Callable[..., Any]) -> None:
    """The magnitude probe: a softmax written by hand without each row's maximum overflows on logits of several
    hundred (inf / inf) and underflows on rows far below zero (0 / 0); multinomial then refuses the NaN."""
    advice = ("A softmax must hold for any logits: use F.softmax, or subtract each row's maximum before exp, so "
              "that the largest term is exp(0) = 1 and no row overflows or underflows to 0/0.")
    for logits, words, peaked in ((_BASE * 200.0, "logits scaled to about \u00b1500", True),
                                  (_BASE - 1000.0, "every logit below -997", False)):
        batch = logits.repeat(20, 1)                                                       # (40, vocab)
        what = f"sample_next_token(logits) on {batch.shape[0]} rows of {words}"
        try:
            drawn = _draw(fn, batch, what)
        except Failure as failure:
            if failure.diagnosis not in ("exception", "normalization"):
                raise
            raise Failure("overflow", f"{failure.message.rstrip().rstrip('.')}. Your sampler works on ordinary "
                                      f"logits, so its softmax breaks on large ones. {advice}",
                          **failure.details) from None
        # logits 200 apart: every other token has a probability below exp(-200), so each draw is the argmax
        if peaked and not torch.equal(drawn, batch.argmax(-1)):
            fail("magnitude", f"{what}: drew tokens other than each row's most likely one, whose probability is "
                              f"1 - exp(-200). {advice}")


def _check_sampling_float64(fn: Callable[..., Any]) -> None:
    """The dtype probe, on what the default dtype reaches: float64 logits in a float64 notebook must still give
    long ids, greedy at temperature 0 and within the top k otherwise (top-k logits scattered into a float32
    buffer meet float64 ones: ``dtype``)."""
    def run() -> None:
        what = f"sample_next_token(temperature=0) on float64 logits {IN_FLOAT64}"
        greedy = _draw(fn, _BASE.double(), what, temperature=0)
        if not torch.equal(greedy, _BASE.argmax(-1)):
            fail("precision", f"{what}: returned {greedy.tolist()}, expected the argmax of each row "
                              f"{_BASE.argmax(-1).tolist()}. Keep the logits' dtype throughout.")
        # a dtype written into the code raises or returns the wrong dtype; few draws show it (the distribution
        # itself was judged in float32)
        what = f"sample_next_token(top_k=3) on float64 logits {IN_FLOAT64}"
        drawn = _draw(fn, _BASE.double().repeat(20, 1), what, top_k=3)                     # (40,)
        allowed = _probabilities(_BASE, 3).repeat(20, 1) > 0                               # (40, vocab)
        if not bool(allowed[torch.arange(drawn.shape[0]), drawn].all()):
            fail("precision", f"{what}: drew tokens outside the 3 most likely of their row, which float64 does not "
                              f"explain. Keep the logits' dtype throughout.")
    run_in_float64(run)


def _check_sampling_device(fn: Callable[..., Any]) -> None:
    """The device probe (``_device_probe``), last: every path again (greedy, the temperature, top-k) on logits on the
    meta device, where a tensor made on the CPU (a -inf filler, a threshold, uniform noise made without device=)
    meets them and raises, and ids copied to the CPU show. A meta tensor holds no numbers, so nothing is drawn: the
    draws themselves were judged above, and torch's random state is put back after (``fork_rng``). No generator is
    passed: a CPU generator cannot draw on a GPU's tensors, so the text's generator is the caller's to place."""
    logits = torch.empty(4, _BASE.shape[-1], device="meta")                            # (4, vocab)
    with torch.random.fork_rng():
        for options in ({"temperature": 0}, {}, {"temperature": 0.5}, {"top_k": 3}, {"temperature": 0.5, "top_k": 3}):
            shown = ", ".join(f"{name}={value}" for name, value in options.items())
            probe_device(lambda options=options: fn(logits.clone(), **options),
                         f"sample_next_token({shown}{', ' if shown else ''}logits on another device than the CPU)")


_EXAMPLE_DRAWS = 2000


def _expected_frequencies(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    return _probabilities(logits / temperature, top_k)


def _drawn(sample: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """How often each token comes up in 2000 draws of ``sample``: the probabilities themselves when within
    the noise of sampling, so that only a real difference is shown."""
    def frequencies(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
        draws = as_tensor(sample(logits.repeat(_EXAMPLE_DRAWS, 1), temperature=temperature, top_k=top_k))
        freq = _frequencies(draws, 1, logits.shape[-1])                                    # (1, vocab)
        expected = _expected_frequencies(logits, temperature, top_k)
        return expected if _matches(freq, expected) else freq
    return frequencies


def _sampling_cases() -> list[Case]:
    logits = tiny(torch.Generator().manual_seed(0), 1, 4)
    return [Case((logits, t, k), f"sample_next_token(logits, temperature={t}, top_k={k}) drawn {_EXAMPLE_DRAWS} "
                                 f"times: how often each token came up") for t, k in ((1.0, None), (0.5, None),
                                                                                   (1.0, 2), (0, None))]


_SAMPLING_EXAMPLE = ProcedureExample(_expected_frequencies, _sampling_cases, ("logits", "temperature", "top_k"))


@checker("5.4", example=lambda fn, *_, **__: function_example(_SAMPLING_EXAMPLE)(_drawn(fn)))
def check_sampling(fn: Callable[..., Any]) -> str:
    """fn(logits (N, V), temperature=1.0, top_k=None, generator=None) -> (N,) long."""
    expect_callable(fn, "sample_next_token")
    torch.manual_seed(0)
    small = torch.tensor([[0.1, 3.0, -1.0, 0.5, 0.0, 1.0],
                          [2.0, -0.5, 0.3, 0.0, 1.5, -2.0],
                          [-1.0, -2.0, -0.5, -3.0, -0.7, -1.5]])
    _draw(fn, small, "sample_next_token(logits of shape (3, 6))")
    _draw(fn, small[:1], "sample_next_token(logits of shape (1, 6))")                 # a batch of one
    _draw(fn, small[:1], "sample_next_token(logits of shape (1, 6), temperature=0)", temperature=0)
    greedy = _draw(fn, small, "sample_next_token(temperature=0.0)", temperature=0.0)   # a float zero too
    if not torch.equal(greedy, small.argmax(-1)):
        for position, how in ((0, "sorted from the largest, always 0"),
                              (small.shape[-1] - 1, "sorted from the smallest, always the last")):
            if bool((greedy == position).all()):
                fail("greedy", f"With temperature=0 the sampler should return the argmax of each row, "
                               f"{small.argmax(-1).tolist()}; yours returned {greedy.tolist()}, the same token for every "
                               f"row. If you sorted the logits, that is the position of the largest logit in the "
                               f"logits {how}, not its token id. Take logits.argmax(-1) of the logits themselves, or "
                               f"map the position back with the sort's indices.")
        if torch.equal(greedy, small.shape[-1] - 1 - small.argmax(-1)):
            fail("greedy", f"With temperature=0 the sampler should return the argmax of each row, "
                           f"{small.argmax(-1).tolist()}; yours returned {greedy.tolist()}, its position in the "
                           f"reversed vocabulary, not its token id: map it back, V - 1 - position (or flip back).")
        fail("greedy", "With temperature=0 the sampler should be greedy and return the argmax of each row; "
                       f"yours returned {greedy.tolist()}, expected {small.argmax(-1).tolist()}.")
    _check_distribution(fn, _BASE, 1.0, None)
    _check_distribution(fn, _BASE + 3.0, 1.0, None)   # all positive: raw logits would not crash multinomial
    _check_distribution(fn, _BASE, 0.5, None)
    _check_top_k_per_row(fn)
    _check_distribution(fn, _BASE, 1.0, 3)
    try:   # the same shape and top_k, other logits: what a call keeps (a top-k threshold cached) shows
        _check_distribution(fn, _BASE.flip(-1) + torch.tensor([[1.0], [-1.0]]), 1.0, 3)   # other thresholds
    except Failure as failure:
        reraise_with(failure, "kept_state", " Yet it was right just before on logits of the same shape with the "
                                            "same top_k: your function keeps something from an earlier call (a "
                                            "cached threshold or result) instead of computing it from the logits.")
    _check_distribution(fn, _BASE, 2.0, 2)
    _check_distribution(fn, _BASE, 1.0, _BASE.shape[-1])   # top_k of the whole vocabulary keeps every token
    top1 = _draw(fn, _BASE.repeat(50, 1), "sample_next_token(top_k=1)", top_k=1)
    if not torch.equal(top1, _BASE.argmax(-1).repeat(50)):
        fail("top_k", "With top_k=1 only the most likely token may be drawn; yours drew others.")
    for options in ({}, {"temperature": 0.5}, {"top_k": 3}):   # the generator reaches every path that draws
        _check_generator_is_used(fn, _BASE.repeat(20, 1), **options)
    _check_global_state_without_generator(fn)
    _check_sampling_magnitude(fn)
    _check_sampling_float64(fn)
    _check_sampling_device(fn)
    return ("Greedy at temperature 0; otherwise draws follow softmax(logits / temperature), restricted to the top k "
            "when asked, and the generator makes them reproducible.")
