"""A training run's losses, and exercise 8.1's verdict on two of them: does the student's GPT
train like the reference?

``capstone.train_parts`` makes the runs; the 8.1 checker (``checks.notebook08``) and
``capstone.find_blame`` judge them here.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from .._validate import describe
from .collect import GPT_EXERCISES
from .verdict import CheckResult

__all__ = ["TOLERANCE", "STALL", "TrainingRun", "how_it_fails", "judge"]

# A correct part gives the reference's numbers up to float rounding: same start, same batches.
# Over a few hundred AdamW steps rounding differences grow to about 1e-3 in the loss (measured:
# reordered but equivalent attention code ends within 0.002). A part that changes what is computed
# moves the loss by far more (a missing scale: +0.05; dropout in the wrong place: NaN or +0.1).
TOLERANCE = 0.02
# A run stalls when its loss falls by less than this from the first steps to the last.
STALL = 0.05
# A loss this far below the reference's is a model that sees what it predicts (measured on the Shakespeare run:
# a mask that shows every key, or one future key, ends at 0.045, 2.16 below); less dropout ends a little below
# (a dropout left out, or training in eval mode: 0.02 to 0.04 below).
FAR_BELOW = 0.5



@dataclass
class TrainingRun:
    """The losses of one run; ``failure`` says why it stopped early, if it did."""

    label: str
    step: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    val_step: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    failure: str | None = None    # "nan" or "exception: ..." when the run could not go on
    model: torch.nn.Module | None = field(default=None, repr=False)
    namespace: dict | None = field(default=None, repr=False)
    # the parts of the GPT that are not the student's in this run, with why ("2.1 (not written yet)"),
    # when the run was asked to use all of them (train_parts(..., None)); None when unknown
    not_yours: tuple[str, ...] | None = None
    # the exercises whose parts the run was asked to take from the student (train_parts(..., yours)); () is
    # the reference's run, the course's parts only; None when every usable part was asked for, or unknown
    yours_asked: tuple[str, ...] | None = None
    # what it was trained on: the setup's name, its batches' seed and the learning rate (None: unknown); the
    # steps show in val_step
    trained_on: tuple | None = None

    @property
    def final_val_loss(self) -> float:
        return self.val_loss[-1] if self.val_loss else float("nan")

    def summary(self) -> str:
        end = f"validation loss {self.final_val_loss:.3f}" if self.failure is None else f"stopped: {self.failure}"
        return f"{self.label}: {len(self.step)} steps, {end}"


def valid_tolerance(value: object) -> float:
    """A tolerance on the final loss: a finite number >= 0 (0 asks for the same numbers)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"tolerance: expected a finite number >= 0 (the course uses {TOLERANCE}), got "
                         f"{describe(value)}")
    return float(value)


def _fall(run: TrainingRun) -> float:
    """How far a run's loss fell: from its start (the mean of its first 10 training losses) to its final
    validation loss."""
    return sum(run.train_loss[:10]) / max(1, min(10, len(run.train_loss))) - run.final_val_loss


def how_it_fails(run: TrainingRun, reference: TrainingRun, tolerance: float) -> str | None:
    """None when ``run`` trains like ``reference``, else how it fails."""
    for name, given in (("run", run), ("reference", reference)):
        if not isinstance(given, TrainingRun):
            raise TypeError(f"{name}: expected a TrainingRun from train_parts(...), got {describe(given)}")
    tolerance = valid_tolerance(tolerance)
    if run.failure == "nan" or not all(math.isfinite(loss) for loss in run.train_loss + run.val_loss):
        return "nan"   # a NaN loss is never within a tolerance, whatever a comparison with it says
    if run.failure is not None:
        return "raises"
    # "stalls" only where the reference learned on the same steps: a run too short for anyone to learn tells
    # nothing about the parts. Both starts are measured alike, the mean of the first 10 training losses.
    if _fall(run) < STALL and _fall(reference) >= STALL:
        return "stalls"
    last = run.final_val_loss
    if last > reference.final_val_loss + tolerance:
        return "diverges"
    if last < reference.final_val_loss - tolerance:
        # equal parts give equal numbers: a loss far below the reference's is a model that sees what it
        # predicts (a causal mask that leaks the future, targets equal to the inputs), not a better one
        return "below"
    return None


def judge(yours: TrainingRun, reference: TrainingRun, tolerance: float = TOLERANCE) -> CheckResult:
    """Exercise 8.1: does your GPT train like the reference (final validation loss within ``tolerance``)?"""
    for name, run in (("yours", yours), ("reference", reference)):
        if not isinstance(run, TrainingRun):
            raise TypeError(f"{name}: expected a TrainingRun from train_parts(...), got {describe(run)}")
    tolerance = valid_tolerance(tolerance)
    if reference.failure is not None:
        raise ValueError(f"reference: the reference run itself failed ({reference.failure}); "
                         f"this is a bug in the course, please report it")
    verdict = how_it_fails(yours, reference, tolerance)
    if verdict is None and yours.not_yours:
        # as the grader: 8.1 judges the student's GPT, and a run where the course's parts stand in for some
        # of it (in a fresh learner copy, all of it) trains like the reference trivially: not written yet
        return CheckResult("8.1", False, "not_implemented",
                           f"Not yours to judge yet: 8.1 trains the GPT built from your parts of notebooks 02-05, "
                           f"and the course's parts stand in for {len(yours.not_yours)} of {len(GPT_EXERCISES)}: "
                           f"{', '.join(yours.not_yours)}. Write them, save the notebooks, and run this notebook "
                           f"again.")
    if verdict is None:
        gap = yours.final_val_loss - reference.final_val_loss
        return CheckResult("8.1", True, None,
                           f"Your GPT trains like the reference: validation loss {yours.final_val_loss:.3f} "
                           f"against {reference.final_val_loss:.3f} ({gap:+.3f}, tolerance {tolerance}).")
    message = {"nan": f"Your GPT's loss became NaN at step {len(yours.step)}.",
               "raises": f"Training your GPT failed: {yours.failure}.",
               "stalls": "Your GPT's loss does not go down.",
               "diverges": (f"Your GPT ends at validation loss {yours.final_val_loss:.3f}, the reference at "
                            f"{reference.final_val_loss:.3f}: more than {tolerance} behind."),
               "below": (f"Your GPT ends at validation loss {yours.final_val_loss:.3f}, the reference at "
                         f"{reference.final_val_loss:.3f}: more than {tolerance} BELOW it. Parts that compute what "
                         f"the reference computes give its numbers up to rounding (and dropout drawn in another "
                         f"layout), so one of yours differs. "
                         + ("So far below, it sees what it predicts: a causal mask that lets the future through, "
                            "or targets that are not shifted." if reference.final_val_loss - yours.final_val_loss
                            > FAR_BELOW else
                            "A little below is what less dropout gives over these steps (a dropout left out, or "
                            "the model in eval mode while it trains); a model that sees what it predicts (a mask "
                            "that leaks the future) ends far lower."))}[verdict]
    diagnosis = {"nan": "nan", "raises": "exception"}.get(verdict, "mismatch")
    return CheckResult("8.1", False, diagnosis, message + " find_blame(...) names the part.")
