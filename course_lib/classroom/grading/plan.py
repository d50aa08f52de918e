"""What is graded: each exercise, the name its cell defines, and how the course's notebook checks it.

The check of an exercise is read from the course's own solution notebook rather than kept in a
second table: it is the code cell right after the exercise cell (``checks.check_causal_mask(
causal_mask)``; 1.1's cell also calls ``my_prediction()`` first), plus any code cells right after
it that only call a checker on the exercise's name again (4.2 is checked pre-norm, then post-norm).
The grader runs that text, the course's and never the student's, on the student's definition.

Which name an exercise defines: the one ``def``/``class`` of its cell, or, where the cell defines
several (9.2's ``rotate_half`` and ``apply_rotary``), the one holding the ``### BEGIN SOLUTION``
marker; the cell's other definitions are the exercise's helpers and come with the student's part.

Exercise 8.1 has no exercise cell: its check compares a GPT built from the student's parts of
notebooks 02-05 with the reference after both trained on names, as notebook 08 does. It trains two
small models per student (17 s on a busy 2-core machine), so it is graded only when asked for.
"""
from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import nbformat

from ...course_files import course_notebooks
from .. import notebook_reader as reader
from ..collect import every_exercise
from ..exercises import exercise_order

__all__ = ["ExercisePlan", "grading_plan", "graded_exercises", "default_exercises", "CAPSTONE", "CAPSTONE_CHECK"]

CAPSTONE = "8.1"
CAPSTONE_NOTEBOOK = "08_train_your_gpt.ipynb"
# Notebook 08's first check (its section 1), without the prints and plots between its cells; ``parts``
# (``collect_student_parts(".")`` in the notebook) is collected by the grader first, see ``judge``.
CAPSTONE_CHECK = """\
names = capstone.names_setup(steps=300)
reference = capstone.train_parts(parts, [], names, label="reference")
yours = capstone.train_parts(parts, None, names, label="yours")
verdict = checks.check_trains_like_reference(yours, reference)
"""


@dataclass(frozen=True)
class ExercisePlan:
    """One graded exercise: where the student defines it and the course's code that checks it."""

    id: str
    name: str          # what the exercise cell defines ("causal_mask"); "" for 8.1
    notebook: str      # file name, "02_masked_attention.ipynb"
    cell_id: str       # the exercise cell's id in the course's notebook ("" for 8.1)
    solution: str      # the course's definition, imports included ("" for 8.1)
    check: str         # the course's check cell(s), run after the definition

    @property
    def number(self) -> str:
        """The notebook's two-digit number, "02"."""
        return self.notebook[:2]


def _calls_checker(node: ast.stmt) -> list[ast.Call]:
    """The ``checks.check_*(...)`` calls of one statement."""
    return [call for call in ast.walk(node) if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute) and call.func.attr.startswith("check_")
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "checks"]


def _only_checks_of(source: str, name: str) -> bool:
    """True when every statement of the cell is a checker call (or its result, shown) on ``name``."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return False
    calls = [call for node in body for call in _calls_checker(node)]
    return bool(calls) and all(isinstance(node, (ast.Expr, ast.Assign)) for node in body) and all(
        any(isinstance(arg, ast.Name) and arg.id == name for arg in call.args) for call in calls)


def _check_source(path: Path, cell_id: str, exercise_id: str, name: str) -> str:
    cells = nbformat.read(path, as_version=4).cells
    index = next((i for i, cell in enumerate(cells) if cell.get("id") == cell_id), None)
    rest = cells[index + 1:] if index is not None else []
    first = next((i for i, cell in enumerate(rest) if cell.cell_type == "code"), None)
    if first is None or not _calls_checker_anywhere(rest[first].source):
        found = "nothing" if first is None else repr(rest[first].source[:80])
        raise LookupError(f"{path.name}: expected the code cell after exercise {exercise_id}'s cell to call a "
                          f"checker (checks.check_...), found {found}")
    sources = [rest[first].source]
    for cell in rest[first + 1:]:
        if cell.cell_type != "code" or not _only_checks_of(cell.source, name):
            break
        sources.append(cell.source)
    return "\n\n".join(sources)


def _calls_checker_anywhere(source: str) -> bool:
    try:
        return any(_calls_checker(node) for node in ast.parse(source).body)
    except SyntaxError:
        return False


def graded_exercises(notebooks: list[Path] | None = None) -> dict[str, reader.ExerciseCell]:
    """Every exercise with an exercise cell, by id: ``collect``'s (one name per cell), and the cells
    that define helpers beside the exercise's name (9.2), which ``collect`` leaves out."""
    return dict(_graded_exercises(tuple(course_notebooks() if notebooks is None else notebooks)))


@functools.lru_cache(maxsize=4)
def _graded_exercises(notebooks: tuple[Path, ...]) -> dict[str, reader.ExerciseCell]:
    return every_exercise(notebooks)


def grading_plan(exercises: list[str] | None = None) -> dict[str, ExercisePlan]:
    """The plan of each exercise in ``exercises`` (default: :func:`default_exercises`), in course order.

    Raises ``ValueError`` naming ``exercises`` for an id the course does not have.
    """
    notebooks = course_notebooks()
    found = graded_exercises(notebooks)
    by_name = {path.name: path for path in notebooks}
    known = sorted([*found, CAPSTONE], key=exercise_order)
    wanted = default_exercises() if exercises is None else list(exercises)
    unknown = [ex_id for ex_id in wanted if ex_id not in known]
    if unknown or not wanted:
        raise ValueError(f"exercises: expected ids among {known}, got {unknown or wanted}")
    plans: dict[str, ExercisePlan] = {}
    for ex_id in sorted(set(wanted), key=exercise_order):
        if ex_id == CAPSTONE:
            plans[ex_id] = ExercisePlan(ex_id, "", CAPSTONE_NOTEBOOK, "", "", CAPSTONE_CHECK)
            continue
        ex = found[ex_id]
        plans[ex_id] = ExercisePlan(ex_id, ex.name, ex.notebook, ex.cell_id, ex.solution,
                                    _check_source(by_name[ex.notebook], ex.cell_id, ex_id, ex.name))
    return plans


def default_exercises() -> list[str]:
    """Every exercise with an exercise cell (1.1 to 7.2 and 9.1 to 12.3): all but 8.1, which trains
    two models per student and is graded only when asked for (``--exercises all`` or ``8.1``)."""
    return sorted(graded_exercises(), key=exercise_order)
