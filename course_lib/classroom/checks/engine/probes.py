"""What every exercise gets besides the comparison of its outputs: the shared probes.

Each exercise lists the probes it gets (``FunctionExercise.probes``); a test holds every exercise of
the table to the list that applies to it (``tests/test_checks_bank.py``). Where a probe lives today:

- ``gradient``: one backward pass beside the reference's, gradient by gradient (``_gradients``).
- ``mutation``: an input changed in place is a verdict (``_student_code.call``, on every call).
- ``reference_guard``: the exercise's own reference doing the work is a verdict (``reference_guard``,
  entered by ``engine.run`` around every check).
- ``counterexample``: the smallest input on which the student and the reference differ (``example``).
- ``device``: the output on the inputs' device (``_student_code.expect_cpu``; ``_device_probe`` for modules).

Slots of issue 43, named here so that an exercise can list them once they are written, one function
each in this module: ``magnitude`` (large scores, very negative rows, rows of different scales),
``dtype`` (the notebook's default dtype, float64 too), ``saved_tensors`` (tensors saved for backward
unchanged), ``model_state`` (hooks, training mode, requires_grad restored), ``global_state`` (a
patched torch or course function found during a check is a verdict of its own).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._gradients import check_function_gradients

# Every probe an exercise may list, written or not yet: a declaration naming another is a typo.
PROBES = ("gradient", "mutation", "reference_guard", "counterexample", "device",
          "magnitude", "dtype", "saved_tensors", "model_state", "global_state")


def gradient_probe(fn: Callable[..., Any], reference: Callable[..., Any], args: Sequence[Any],
                   names: Sequence[str], what: str) -> None:
    """Backpropagate the same loss through the student's function and the reference on ``args``; the
    floating-point tensors among them are compared by their names in ``names`` (the others are skipped)."""
    floats = [name for name, a in zip(names, args) if getattr(a, "is_floating_point", lambda: False)()]
    check_function_gradients(fn, reference, *args, names=floats, what=what)
