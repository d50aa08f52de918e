"""Hints and solutions of the exercises declared in ``classroom.exercises``, and how far each has gone.

The verdict and its diagnoses live in ``classroom.verdict``; one run of a checker, which keeps the last
verdict of each exercise that the hints follow, in ``engine.run``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import _validate as validate
from ..exercises import Exercise, exercise
from ..notebook_reader import marked_exercises, marker, read_cells  # the solution markers, as every tool reads them
from ..verdict import CheckResult
from ._nudges import nudge
from .engine.run import last

__all__ = ["hint", "show_solution", "solution_source", "hint_state", "Shown"]


@dataclass
class HintState:
    """How far ``checks.hint`` went for one exercise in this kernel: the spec's hints shown, and the failed
    verdict the hints follow now with the step reached."""

    shown: int = 0
    followed: Any = None
    step: int = 0


class Shown(str):
    """Text that hint and show_solution print once. As a cell's last value it displays nothing more
    (``_ipython_display_``), so a notebook shows it once, never a second time as a quoted string."""

    def _ipython_display_(self) -> None:
        return None


_STATES: dict[str, HintState] = {}


def hint_state(exercise_id: str) -> HintState:
    """The hint state of an exercise in this kernel (tests reset it)."""
    entry = exercise(exercise_id)
    return _STATES.setdefault(entry.id, HintState())


def hint(exercise_id: str) -> Shown:
    """The next hint for an exercise, printed once (each call goes one level deeper, never the full code).

    After a failed check of the exercise the hints follow that verdict: first a nudge written for its
    mistake, then a counter-example (the smallest input on which your code and the reference differ,
    side by side), then the next step of the spec. Without one, the spec's hints in order."""
    entry = exercise(exercise_id)
    state = hint_state(entry.id)
    result = last(entry.id)
    if result is not None and not result.passed and result.diagnosis not in ("not_implemented", "checker_error"):
        if state.followed is not result:
            state.followed, state.step = result, 0
        text = _following(entry, state, result)
    else:
        text = _spec_hint(entry, state)
    print(text)
    return Shown(text)


def _spec_hint(entry: Exercise, state: HintState) -> str:
    level = min(state.shown, len(entry.hints) - 1)
    state.shown += 1
    return f"Hint {level + 1}/{len(entry.hints)} for exercise {entry.id} ({entry.title}): {entry.hints[level]}"


def _following(entry: Exercise, state: HintState, result: CheckResult) -> str:
    """Hints that follow the last failed verdict: the nudge, the counter-example, then the spec's steps."""
    example = result.details.get("counterexample") if isinstance(result.details, dict) else None
    steps = ["nudge"] + (["example"] if example is not None else [])
    step, state.step = state.step, state.step + 1
    head = f"Hint for exercise {entry.id} ({entry.title}), after your last check ({result.diagnosis})"
    if step < len(steps) and steps[step] == "nudge":
        more = " The next hint shows a counter-example." if example is not None else ""
        return f"{head}: {nudge(result.diagnosis, example=example is not None, exercise=entry.id)}{more}"
    if step < len(steps):
        given = "inputs and weights" if any(name.startswith("self.") for name, _ in example.notes) else "inputs"
        return (f"{head}: a counter-example.\n{example.text()}\nFind the first entry that differs and work it "
                f"out by hand from the {given} above.")
    return _spec_hint(entry, state)


def _notebook(entry: Exercise) -> Path:
    from ...course_files import notebooks_dir
    found = sorted(notebooks_dir().glob(f"{entry.notebook}_*.ipynb"))
    if not found:
        raise FileNotFoundError(f"exercise {entry.id}: expected notebook {entry.notebook}_*.ipynb in "
                                f"{notebooks_dir()}, found none")
    return found[0]


def solution_source(exercise_id: str) -> str:
    """The code cell holding the exercise's solution region, as written in its solution notebook."""
    entry = exercise(exercise_id)
    path = _notebook(entry)
    for cell in read_cells(path):
        if cell.cell_type == "code" and entry.id in marked_exercises(cell.source):
            if not any((m := marker(line)) is not None and m.kind == "end" for line in cell.source.splitlines()):
                raise ValueError(f"{path.name}: the solution region of exercise {entry.id} has no "
                                 f"### END SOLUTION")
            return cell.source
    raise LookupError(f"{path.name}: expected a code cell with '### BEGIN SOLUTION (Exercise {entry.id}: "
                      f"...)', found none")


def show_solution(exercise_id: str, force: bool = False) -> Shown:
    """Print the exercise's solution cell from its notebook, once you have tried: after a check of the
    exercise has run in this kernel, or with ``force=True`` (instructors)."""
    entry = exercise(exercise_id)
    validate.boolean("force", force)
    if not entry.has_solution:
        text = (f"Exercise {entry.id} ({entry.title}) has no solution to show: notebook {entry.notebook} "
                f"assembles the parts you wrote in earlier notebooks. Use checks.hint({entry.id!r}).")
        print(text)
        return Shown(text)
    if not force and last(entry.id) is None:
        text = (f"Try exercise {entry.id} ({entry.title}) first: run its check cell at least once, and "
                f"checks.hint({entry.id!r}) when stuck. The solution is shown after a checked attempt "
                f"(or with checks.show_solution({entry.id!r}, force=True)).")
        print(text)
        return Shown(text)
    code, summary = _without_markers(solution_source(entry.id))
    text = (f"# Solution of exercise {entry.id} ({entry.title}), from notebook {_notebook(entry).name}"
            + (f"\n# {summary}" if summary else "") + f"\n{code}")
    print(text)
    return Shown(text)


def _without_markers(source: str) -> tuple[str, str | None]:
    """The cell's code with its ### BEGIN/END SOLUTION lines left out (the code a student would type), and the
    BEGIN marker's summary of the exercise ("running maximum m and sum l ...") without its "Exercise X.Y: "."""
    kept, summary = [], None
    for line in source.splitlines():
        found = marker(line)
        if found is None:
            kept.append(line)
        elif found.kind == "begin" and found.text and summary is None:
            summary = re.sub(r"^\s*Exercise\s+\d+\.\d+\s*:?\s*", "", found.text).strip() or None
    return "\n".join(kept).rstrip() + "\n", summary
