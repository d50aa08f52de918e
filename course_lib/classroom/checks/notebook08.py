"""Exercise of notebook 08 (train your GPT): 8.1, your parts train like the reference.

Notebook 08 has no solution region: the learner assembles parts written in earlier notebooks
(``capstone.train_parts``), so 8.1 is declared with ``has_solution=False`` (``classroom.exercises``) and its checker only
compares two finished runs through ``training_runs.judge``.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from ..collect import GPT_EXERCISES
from ..training_runs import TOLERANCE, TrainingRun, judge, valid_tolerance
from ..verdict import fail
from .engine import checker
from .engine.example import compare

__all__ = ["check_trains_like_reference"]


def _curves(yours: Any, reference: Any, *_: Any, **__: Any) -> Any:
    """The two runs' validation losses side by side: the engine's comparison (two given runs, nothing to search)."""
    if not (isinstance(yours, TrainingRun) and isinstance(reference, TrainingRun)):
        return None
    return compare(f"the validation loss at steps {reference.val_step} (your run, then the reference)", [],
                   lambda: torch.tensor(yours.val_loss, dtype=torch.float64),
                   lambda: torch.tensor(reference.val_loss, dtype=torch.float64))


def _check_which_run_is_which(yours: TrainingRun, reference: TrainingRun) -> None:
    """The two runs are two, and each is what its place says: how train_parts was asked for it tells (the
    reference's with none of the student's parts, the student's with every usable one)."""
    order = "the order is check_trains_like_reference(yours, reference), your run first"
    if yours is reference:
        fail("exception", "The same run is passed as `yours` and as `reference`: it can only agree with itself. "
                          "Pass your run, capstone.train_parts(parts, None, ...), and the reference's, "
                          "capstone.train_parts(parts, [], ...).")
    yours_is_the_course = yours.yours_asked == ()
    reference_is_yours = reference.not_yours is not None or bool(reference.yours_asked)
    if yours_is_the_course and reference_is_yours:
        fail("exception", f"The run passed as `yours` trained the course's parts only, and the one passed as "
                          f"`reference` trained yours: {order}.")
    if yours_is_the_course:
        fail("exception", "The run passed as `yours` trained the course's parts only (capstone.train_parts(parts, "
                          "[], ...)): it is a reference run. Pass the run of your parts, capstone.train_parts(parts, "
                          "None, ...).")
    if reference_is_yours:
        fail("exception", "The run passed as `reference` trained your parts: the reference is "
                          "capstone.train_parts(parts, [], ...), the course's parts only: the yardstick your parts are "
                          "measured against.")
    some = yours.yours_asked
    if some is not None and not set(GPT_EXERCISES) <= set(some):
        fail("exception", f"The run passed as `yours` trained only some of your parts ({', '.join(some)}), the "
                          f"course's standing in for the rest: 8.1 judges the GPT built from all of them. Pass "
                          f"capstone.train_parts(parts, None, ...).")
    trained = {"yours": yours.trained_on, "the reference": reference.trained_on}
    if None not in trained.values() and yours.trained_on != reference.trained_on:
        shown = "; ".join(f"{name}: setup {t[0]!r}, seed {t[1]}, learning rate {t[2]}" for name, t in trained.items())
        fail("exception", f"The two runs are not the same training ({shown}): train both with one setup and the "
                          f"same steps, so that only the parts differ.")
    if yours.failure is None and reference.failure is None and yours.val_step != reference.val_step:
        fail("exception", f"The two runs are not the same training: yours was validated at steps {yours.val_step}, "
                          f"the reference at {reference.val_step}. Train both with one setup and the same steps.")


@checker("8.1", example=_curves, options={"tolerance": valid_tolerance})   # >= 0: judge refuses a negative one
def check_trains_like_reference(yours: Any, reference: Any, tolerance: float | None = None) -> str:
    """``yours`` and ``reference``: TrainingRuns from ``capstone.train_parts``; the verdict is ``judge``'s."""
    for name, run in (("yours", yours), ("reference", reference)):
        if not isinstance(run, TrainingRun):
            # judge raises on this; a checker answers instead (a wrong argument is the learner's slip)
            fail("exception", f"`{name}` should be a TrainingRun, the result of capstone.train_parts(...), "
                              f"got {type(run).__name__}.")
        losses = run.train_loss + run.val_loss
        if run.failure is None and (not run.train_loss or not run.val_loss):   # a failed run may stop at step 1
            fail("exception", f"`{name}` holds no losses: pass the TrainingRun that capstone.train_parts(...) "
                              f"returned after it trained.")
        odd = next((loss for loss in losses if isinstance(loss, bool) or not isinstance(loss, numbers.Real)), None)
        if odd is not None:
            fail("exception", f"`{name}`'s losses should be numbers, as capstone.train_parts(...) records them; one "
                              f"is {type(odd).__name__}.")
    _check_which_run_is_which(yours, reference)
    if reference.failure is None and not all(math.isfinite(x) for x in reference.train_loss + reference.val_loss):
        fail("exception", "The run passed as `reference` has a NaN or infinite loss but no failure: pass the "
                          "TrainingRun capstone.train_parts(parts, [], ...) returned, as it is.")
    if reference.failure is not None and yours.failure is None:
        fail("exception", f"The run passed as `reference` failed ({reference.failure}) and the one passed as `yours` "
                          f"did not: the order is check_trains_like_reference(yours, reference), your run first.")
    verdict = judge(yours, reference, TOLERANCE if tolerance is None else tolerance)
    if not verdict.passed:
        # the harness builds the same CheckResult (8.1, not passed, judge's diagnosis and message)
        fail(verdict.diagnosis, verdict.message, **verdict.details)
    return verdict.message
