"""Verdicts as nbgrader needs them: a graded check that fails also fails its cell.

nbgrader scores an autograded test cell by its outputs: an error scores zero; a cell result (an
``Out[n]``) is read as a partial-credit score, full marks with a warning when it is no number;
anything else scores full marks. Our checkers never raise and return their verdict as the cell
result, so while nbgrader runs a notebook (``nbgrader autograde`` and ``nbgrader validate`` set
``NBGRADER_EXECUTION`` to "autograde" or "validate"), for a graded check:

- a failed verdict raises :class:`CheckNotPassed`, whose text is the verdict (exercise, diagnosis,
  message): the test cell scores zero and nbgrader's feedback says which mistake it was;
- a passed verdict is shown as a display (the same green box) rather than as the cell result, so
  nbgrader gives full marks without reading the box as a score.

A check is not graded when it is called with ``graded=False`` (a demonstration on planted buggy
code, or a re-check used as a condition: ``yours if checks.check_x(yours, graded=False) else
reference``), or when its exercise has no solution region (8.1 assembles the parts of earlier
notebooks; nbgrader does not grade it, see ``course_lib.classroom.nbgrader_metadata``). Outside nbgrader
nothing changes: the verdict comes back as always.
"""
from __future__ import annotations

import os

from ..exercises import BY_ID
from ..verdict import CheckResult

NBGRADER_EXECUTION = "NBGRADER_EXECUTION"   # set by nbgrader while it executes a notebook


class CheckNotPassed(AssertionError):
    """A graded check failed while nbgrader ran the notebook; the text is the verdict."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback (nbgrader's feedback too): the verdict, not our frames
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


class _DisplayedResult(CheckResult):
    """A passed verdict that shows itself as a display, not as the cell result (see the module docstring)."""

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display({"text/plain": str(self), "text/html": self._repr_html_()}, raw=True)


def under_nbgrader() -> bool:
    """True while nbgrader (autograde or validate) executes the notebook."""
    return bool(os.environ.get(NBGRADER_EXECUTION))


def _graded(result: CheckResult, graded: bool) -> bool:
    entry = BY_ID.get(result.exercise)
    return graded and (entry is None or entry.has_solution) and under_nbgrader()


def for_nbgrader(result: CheckResult, graded: bool) -> CheckResult:
    """``result`` unchanged, except for a graded check under nbgrader: raise if it failed, display it if it passed."""
    if not _graded(result, graded):
        return result
    if not result.passed:
        raise CheckNotPassed(str(result))
    return _DisplayedResult(result.exercise, result.passed, result.diagnosis, result.message, result.details)
