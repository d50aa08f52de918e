"""A student's definition of each exercise, read from their notebook without running any of it.

What a definition takes with it is ``notebook_reader.student_definition``'s rule, the one every tool reads
by. An unfinished exercise (the learner copy's ``raise NotImplementedError``) is kept as it is, so that the
checker gives it its own verdict (``not_implemented``), never a pass from the course's solution.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .. import notebook_reader as reader
from .plan import ExercisePlan

__all__ = ["StudentPart", "candidates", "find_notebook", "unfinished_exercises", "student_part"]


@dataclass(frozen=True)
class StudentPart:
    """What was found for one exercise: ``source`` to run, or why there is nothing to run."""

    exercise: str
    source: str | None             # the definition with what it needs, in notebook order
    diagnosis: str | None = None   # when there is nothing to run: "missing" or "exception"
    message: str = ""
    note: str = ""                 # said with the verdict: where the definition was found


def candidates(names: list[str], notebook: str) -> list[str]:
    """The student's files that could be the course notebook ``notebook``: the same name first, then
    every other file starting with the same two-digit number ("02_masked_attention (1).ipynb")."""
    number = notebook[:2]
    alike = sorted(name for name in names if name != notebook and name.endswith(".ipynb")
                   and re.match(rf"{number}\D", name))
    return ([notebook] if notebook in names else []) + alike


def find_notebook(names: list[str], notebook: str, unfinished: dict[str, int] | None = None
                  ) -> tuple[str | None, str]:
    """The student's file for the course notebook ``notebook``, and a note (why none, or which files
    were left aside). Among several candidates (see :func:`candidates`), the one with the fewest
    unfinished exercises (``unfinished``: file name -> count, see :func:`unfinished_exercises`) is
    graded; on a tie the course's own name wins, and two other names tie as ambiguous."""
    found = candidates(names, notebook)
    if not found:
        return None, f"no {notebook} in the submission"
    if len(found) == 1:
        return found[0], ""
    counts = unfinished or {}
    fewest = min(counts.get(name, 0) for name in found)
    top = [name for name in found if counts.get(name, 0) == fewest]
    if len(top) > 1 and top[0] != notebook:
        return None, f"several notebooks could be {notebook} ({', '.join(top)}); hand in one"
    chosen = top[0]
    others = ", ".join(name for name in found if name != chosen)
    return chosen, f"graded {chosen} as {notebook}; ignored {others}"


def unfinished_exercises(notebook_text: str) -> int:
    """How many exercises of a notebook still raise the learner copy's NotImplementedError (an
    unreadable file: as many as can be, so that a readable candidate is preferred)."""
    try:
        cells = reader.cells_from_text(notebook_text)
        return len(set().union(*(reader.unfinished_exercises(cell.source) for cell in cells
                                 if cell.cell_type == "code")))
    except Exception:  # the student's file: anything unreadable, a cell of the wrong shape
        return 1 << 20


def _code_number(cells: list, index: int) -> int:
    """The 1-based number of cell ``index`` among the notebook's code cells."""
    return sum(1 for cell in cells[:index + 1] if cell.cell_type == "code")


def student_part(notebook_text: str | None, plan: ExercisePlan, known: set[str], *,
                 missing_detail: str = "") -> StudentPart:
    """The student's definition for ``plan`` from the notebook's text (None: no such notebook).

    ``known``: the names the course provides to every exercise (never taken from the student's
    other code). ``missing_detail`` says why there is no notebook.
    """
    if notebook_text is None:
        return StudentPart(plan.id, None, "missing", missing_detail or f"no {plan.notebook} in the submission")
    try:
        cells = reader.cells_from_text(notebook_text)
    except Exception as err:  # the student's file: anything unreadable is a missing exercise
        return StudentPart(plan.id, None, "missing", f"{plan.notebook} cannot be read as a notebook "
                                                      f"({type(err).__name__}: {str(err)[:200]})")
    found = reader.student_definition(cells, plan.name, plan.cell_id, known)
    if found.problem == "no_cell":
        return StudentPart(plan.id, None, "missing", f"no cell of {plan.notebook} defines {plan.name}")
    if found.problem == "syntax":
        return StudentPart(plan.id, None, "exception",
                           f"Your cell defining {plan.name} does not compile ({found.detail}). "
                           f"Fix it, run the cell, then save the notebook.")
    if found.problem == "too_deep":
        return StudentPart(plan.id, None, "exception",
                           f"Your cell defining {plan.name} is too deeply nested for Python to compile "
                           f"({found.detail}). Simplify it, run the cell, then save the notebook.")
    if found.problem == "not_defined":
        return StudentPart(plan.id, None, "missing", f"the exercise cell no longer defines {plan.name} {reader.TOP_LEVEL}")
    note = (f"(Graded your definition of {plan.name} in code cell {_code_number(cells, found.cell)}: "
            f"the exercise's own cell no longer defines it.)") if found.moved else ""
    return StudentPart(plan.id, found.source, note=note)
