"""The exercise registry: each exercise's title, hints and solution (read from its notebook).

The harness (results, isolation, time limit, calls into student code) lives in ``_harness``;
its names (and ``_expect.expect_tensor``) are re-exported here for the modules and tests that
import them from ``_core``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._expect import expect_tensor
from ._harness import DIAGNOSES, CheckResult, Failure, call, checker, fail

__all__ = ["DIAGNOSES", "CheckResult", "Failure", "call", "checker", "expect_tensor", "fail",
           "EXERCISES", "register", "hint", "show_solution", "solution_source"]


@dataclass
class Exercise:
    exercise: str
    title: str
    hints: list[str]
    notebook: str          # the notebook's number, "02": its solution region is read from there
    shown: int = 0
    has_solution: bool = True   # False where the notebook has no solution region (8.1 assembles parts)


EXERCISES: dict[str, Exercise] = {}


def register(exercise: str, title: str, hints: list[str], solution: str | bool | None = None) -> None:
    """Declare an exercise: its id ("2.1"), a title and two or three hints. The solution is read from
    the exercise's notebook; ``solution=False`` says the notebook has none (any other value is unused,
    kept so older callers still work)."""
    if not re.fullmatch(r"\d+\.\d+", str(exercise)):
        raise ValueError(f"exercise: expected an id such as '2.1', got {exercise!r}")
    EXERCISES[exercise] = Exercise(exercise, title, list(hints), f"{int(exercise.split('.')[0]):02d}",
                                   has_solution=solution is not False)


def _lookup(exercise: Any) -> Exercise:
    key = str(exercise)
    if key not in EXERCISES:
        raise ValueError(f"exercise_id: expected one of {sorted(EXERCISES, key=_order)}, got {exercise!r}")
    return EXERCISES[key]


def _order(exercise: str) -> tuple[int, ...]:
    return tuple(int(part) for part in exercise.split("."))


def hint(exercise_id: str) -> str:
    """The next hint for an exercise (each call goes one level deeper, never the full code)."""
    entry = _lookup(exercise_id)
    level = min(entry.shown, len(entry.hints) - 1)
    entry.shown += 1
    text = f"Hint {level + 1}/{len(entry.hints)} for exercise {entry.exercise} ({entry.title}): {entry.hints[level]}"
    print(text)
    return text


# The markers as course_lib.assignments defines them: alone on their line, indentation allowed;
# the BEGIN marker names its exercise, "### BEGIN SOLUTION (Exercise 2.2: ...)".
_BEGIN_RE = re.compile(r"^[ \t]*### BEGIN SOLUTION[ \t]*\([ \t]*Exercise[ \t]+(?P<id>\d+\.\d+)\b.*\)[ \t]*$")
_END_RE = re.compile(r"^[ \t]*### END SOLUTION[ \t]*$")


def _notebook(entry: Exercise) -> Path:
    from ..course_files import notebooks_dir
    found = sorted(notebooks_dir().glob(f"{entry.notebook}_*.ipynb"))
    if not found:
        raise FileNotFoundError(f"exercise {entry.exercise}: expected notebook {entry.notebook}_*.ipynb in "
                                f"{notebooks_dir()}, found none")
    return found[0]


def solution_source(exercise_id: str) -> str:
    """The code cell holding the exercise's solution region, as written in its solution notebook."""
    entry = _lookup(exercise_id)
    path = _notebook(entry)
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    for cell in cells:
        if cell.get("cell_type") != "code":
            continue
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        lines = source.splitlines()
        for i, line in enumerate(lines):
            match = _BEGIN_RE.match(line)
            if match and match["id"] == entry.exercise:
                if not any(_END_RE.match(rest) for rest in lines[i + 1:]):
                    raise ValueError(f"{path.name}: the solution region of exercise {entry.exercise} has no "
                                     f"### END SOLUTION")
                return source
    raise LookupError(f"{path.name}: expected a code cell with '### BEGIN SOLUTION (Exercise {entry.exercise}: "
                      f"...)', found none")


def show_solution(exercise_id: str) -> str:
    """Print the exercise's solution cell from its notebook (for instructors, or after a real attempt)."""
    entry = _lookup(exercise_id)
    if not entry.has_solution:
        text = (f"Exercise {entry.exercise} ({entry.title}) has no solution to show: notebook {entry.notebook} "
                f"assembles the parts you wrote in earlier notebooks. Use checks.hint({entry.exercise!r}).")
        print(text)
        return text
    source = solution_source(entry.exercise)
    print(f"# Solution of exercise {entry.exercise} ({entry.title}), from notebook {_notebook(entry).name}\n"
          f"{source}")
    return source
