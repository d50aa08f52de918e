"""nbgrader cell metadata for the course notebooks, written from their solution markers and check calls.

    python -m course_lib.classroom.nbgrader_metadata notebooks            # write it where it differs
    python -m course_lib.classroom.nbgrader_metadata --check notebooks    # exit 1 naming each cell that differs

With this metadata ``nbgrader generate_assignment`` and ``nbgrader autograde`` work with nbgrader's
default settings. The rules (nbgrader's cell metadata, schema version 3):

- A code cell with a ``### BEGIN SOLUTION (Exercise X.Y: ...)`` region is an autograded answer
  cell ("solution"), grade_id ``exX_Y_solution``. nbgrader replaces the region by its own stub
  (``raise NotImplementedError()``); our learner copies keep theirs, which names the exercise.
- A code cell that calls a checker, ``checks.check_...(...)``, is an autograded test cell, read-only,
  worth :data:`POINTS_PER_CHECK` point, grade_id ``exX_Y_check`` (``exX_Y_check_2``, ... for further
  check cells of the same exercise). Under nbgrader a failed check raises (``checks.engine.run``),
  so the cell scores zero and the feedback shows the diagnosis.
- A check called with ``graded=False`` (a demonstration on planted buggy code, or a re-check used
  as a condition) is no test, and a check of an exercise without a solution region (8.1, which
  assembles the parts of earlier notebooks) is not graded by nbgrader: neither cell gets metadata.
- Every other cell has no nbgrader metadata; an entry found there is removed.

A notebook that nbgrader could not grade as intended is refused with the reason: a marker without
its exercise, a solution and a check in one cell, checks of two exercises in one cell, a graded
check of another notebook's exercise, an exercise with no graded check, or a cell that is not a
solution cell but holds "BEGIN SOLUTION" or "END SOLUTION" (nbgrader reads those words anywhere,
markdown included, as a marker).

Only cell metadata changes: the file is rewritten as nbformat writes it (keys sorted, one-space
indent), so sources, outputs and everything else stay byte for byte.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import _validate as validate
from .._atomic import atomic_file
from .._validate import describe
from . import notebook_reader as reader
from .exercises import BY_ID, EXERCISES

__all__ = ["POINTS_PER_CHECK", "SCHEMA_VERSION", "expected_metadata", "differences", "apply", "main"]

SCHEMA_VERSION = 3          # nbgrader 0.6 to 0.9 read and write cell metadata schema 3
POINTS_PER_CHECK = 1        # each test cell; an exercise with two check cells (4.2) is worth two

# What nbgrader's ClearSolutions takes for a marker: these words anywhere on a line, in any cell.
_NBGRADER_DELIMITERS = ("BEGIN SOLUTION", "END SOLUTION")


def _source(cell: dict[str, Any]) -> str:
    source = cell.get("source", "")
    return source if isinstance(source, str) else "".join(source)


@dataclass
class _Cell:
    where: str
    solution_of: str | None = None     # exercise id of the solution region(s) in the cell
    checks: str | None = None          # exercise id of the graded check call(s) in the cell


def _solution_exercise(source: str, where: str) -> str | None:
    exercises: set[str] = set()
    # the markers as the one notebook reader reads them; a BEGIN marker must name its exercise here
    for number, line in enumerate(source.splitlines(), start=1):
        if reader.looks_like_marker(line) != "begin":
            continue
        found = reader.marker(line)
        if found is None or found.exercise is None:
            raise ValueError(f"{where}, line {number}: a solution marker must name its exercise for nbgrader's "
                             f"grade_id: '### BEGIN SOLUTION (Exercise X.Y: what to write)', got {line.strip()!r}")
        exercises.add(found.exercise)
    if len(exercises) > 1:
        raise ValueError(f"{where}: solution regions of exercises {sorted(exercises)} in one cell; nbgrader grades "
                         f"a cell as one answer, so give each exercise its own cell")
    return exercises.pop() if exercises else None


def _python(source: str) -> ast.Module | None:
    """The cell's code as Python (IPython's magics translated); None when it is not Python at all."""
    from IPython.core.inputtransformer2 import TransformerManager
    try:
        return ast.parse(TransformerManager().transform_cell(source))
    except SyntaxError:
        return None


def _calls(tree: ast.AST) -> Iterator[ast.Call]:
    """Every call in the code, those inside a magic's code (``%time f()``, ``%%time``) included."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        yield node
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("run_line_magic", "run_cell_magic"):
            for argument in node.args[1:]:   # after the magic's name: its line, and a cell magic's body
                if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                    inner = _python(argument.value)
                    if inner is not None:
                        yield from _calls(inner)


def _graded_check_exercise(source: str, where: str) -> str | None:
    """The exercise of the cell's graded ``checks.check_...(...)`` calls; None when there is none."""
    if "checks." not in source:
        return None
    tree = _python(source)
    if tree is None:
        raise ValueError(f"{where}: the cell calls checks but is not valid Python, so its check calls "
                         f"cannot be read")
    checkers = {entry.checker: entry.id for entry in EXERCISES}
    found: set[str] = set()
    for node in _calls(tree):
        if not (isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "checks"
                and node.func.attr.startswith("check_")):
            continue
        name = node.func.attr
        exercise = checkers.get(name)
        if exercise is None:
            raise ValueError(f"{where}: checks.{name} is not one of the course's checkers")
        graded = next((kw.value for kw in node.keywords if kw.arg == "graded"), ast.Constant(True))
        if not (isinstance(graded, ast.Constant) and isinstance(graded.value, bool)):
            raise ValueError(f"{where}: checks.{name}(..., graded=...) must be the literal True or False, "
                             f"so that this script can tell test cells from demonstrations")
        if graded.value and BY_ID[exercise].has_solution:
            found.add(exercise)
    if len(found) > 1:
        raise ValueError(f"{where}: graded checks of exercises {sorted(found)} in one cell; nbgrader scores a "
                         f"cell as one test, so give each its own cell (or pass graded=False to a re-check)")
    return found.pop() if found else None


def _ids(exercise: str) -> str:
    major, minor = exercise.split(".")
    return f"ex{major}_{minor}"


def _solution(exercise: str) -> dict[str, Any]:
    return {"grade": False, "grade_id": f"{_ids(exercise)}_solution", "locked": False,
            "schema_version": SCHEMA_VERSION, "solution": True, "task": False}


def _test(exercise: str, nth: int) -> dict[str, Any]:
    suffix = "" if nth == 1 else f"_{nth}"
    return {"grade": True, "grade_id": f"{_ids(exercise)}_check{suffix}", "locked": True,
            "points": POINTS_PER_CHECK, "schema_version": SCHEMA_VERSION, "solution": False, "task": False}


def _cells_of(notebook: Any, name: str) -> list[dict[str, Any]]:
    cells = notebook.get("cells") if isinstance(notebook, dict) else None
    if not isinstance(cells, list) or not all(isinstance(c, dict) for c in cells):
        raise ValueError(f"notebook: expected a notebook's JSON (a dict with a list of cells), "
                         f"got {describe(notebook)} for {name}")
    return cells


def expected_metadata(notebook: dict[str, Any], name: str = "notebook") -> list[dict[str, Any] | None]:
    """The nbgrader metadata each cell of ``notebook`` (its JSON as a dict) should have; None for none.

    ``name`` labels the notebook in error messages. Raises ValueError when nbgrader could not grade the
    notebook as intended (see the module docstring)."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str labelling the notebook in messages, got {describe(name)}")
    cells = _cells_of(notebook, name)
    found: list[_Cell] = []
    for index, cell in enumerate(cells, start=1):
        where = f"{name}, cell {index}" + (f" (id {cell['id']})" if cell.get("id") else "")
        source = _source(cell)
        info = _Cell(where)
        if cell.get("cell_type") == "code":
            info.solution_of = _solution_exercise(source, where)
            info.checks = _graded_check_exercise(source, where)
            if info.solution_of and info.checks:
                raise ValueError(f"{where}: a solution region and a graded check of exercise {info.checks} in "
                                 f"one cell; nbgrader needs the answer and its test in separate cells")
        if info.solution_of is None:
            for number, line in enumerate(source.splitlines(), start=1):
                if any(word in line for word in _NBGRADER_DELIMITERS):
                    raise ValueError(f"{where}, line {number}: nbgrader reads {line.strip()!r} as a solution "
                                     f"marker (it looks for 'BEGIN SOLUTION' and 'END SOLUTION' anywhere, in "
                                     f"every cell) and would refuse the notebook; reword it")
        found.append(info)

    solved = {c.solution_of for c in found if c.solution_of}
    checked = {c.checks for c in found if c.checks}
    for info in found:
        if info.checks and info.checks not in solved:
            raise ValueError(f"{info.where}: a graded check of exercise {info.checks}, whose solution region is "
                             f"not in this notebook; nbgrader would grade it here, so pass graded=False")
    for exercise in sorted(solved - checked):
        where = next(c.where for c in found if c.solution_of == exercise)
        raise ValueError(f"{where}: exercise {exercise} has a solution region but no graded check cell in this "
                         f"notebook, so nbgrader would give it no points; add a cell calling its checker")

    seen: dict[str, int] = {}
    metadata: list[dict[str, Any] | None] = []
    for info in found:
        if info.solution_of:
            metadata.append(_solution(info.solution_of))
        elif info.checks:
            seen[info.checks] = seen.get(info.checks, 0) + 1
            metadata.append(_test(info.checks, seen[info.checks]))
        else:
            metadata.append(None)
    return metadata


def _read(path: Path) -> tuple[str, dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"notebook_path: expected an existing .ipynb file, got '{path}'"
                                + (" (a folder)" if path.is_dir() else " (not found)"))
    text = path.read_text(encoding="utf-8")
    try:
        notebook = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"notebook_path: '{path}' is not a notebook's JSON ({err})") from err
    return text, notebook


def _shown(entry: Any) -> str:
    return "none" if entry is None else json.dumps(entry, sort_keys=True)


def _mismatches(path: Path) -> tuple[str, dict[str, Any], list[tuple[int, dict[str, Any], dict[str, Any] | None]]]:
    """The notebook's text and JSON, and (cell number, cell, expected entry) of each cell that differs."""
    text, notebook = _read(path)
    pairs = zip(_cells_of(notebook, path.name), expected_metadata(notebook, path.name))
    return text, notebook, [(index, cell, want) for index, (cell, want) in enumerate(pairs, start=1)
                            if cell.get("metadata", {}).get("nbgrader") != want]


def differences(notebook_path: str | os.PathLike) -> list[str]:
    """One line per cell whose nbgrader metadata is not what :func:`expected_metadata` says; [] when all match."""
    path = validate.path("notebook_path", notebook_path)
    return [f"{path.name}, cell {index}: nbgrader metadata is {_shown(cell.get('metadata', {}).get('nbgrader'))}, "
            f"expected {_shown(want)}" for index, cell, want in _mismatches(path)[2]]


def apply(notebook_path: str | os.PathLike) -> int:
    """Write the expected nbgrader metadata into one notebook; returns how many cells changed (0: untouched)."""
    path = validate.path("notebook_path", notebook_path)
    text, notebook, changed = _mismatches(path)
    for _, cell, want in changed:
        metadata = cell.setdefault("metadata", {})
        if want is None:
            del metadata["nbgrader"]
        else:
            metadata["nbgrader"] = want
    new_text = json.dumps(notebook, sort_keys=True, indent=1, ensure_ascii=False) + "\n"   # as nbformat writes
    if new_text != text:
        with atomic_file(path) as handle:
            handle.write(new_text)
    return len(changed)


def _notebooks(paths: list[str]) -> list[Path]:
    found: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            found.extend(sorted(p for p in path.glob("*.ipynb") if not p.name.startswith(".")))
        elif path.suffix == ".ipynb" and path.is_file():
            found.append(path)
        else:
            raise FileNotFoundError(f"paths: expected notebooks (.ipynb) or folders of them, got '{given}'"
                                    + ("" if path.exists() else " (not found)"))
    if not found:
        raise FileNotFoundError(f"paths: expected at least one notebook, found none in {paths}")
    return found


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.classroom.nbgrader_metadata [--check] PATH...``"""
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.classroom.nbgrader_metadata",
        description="Write nbgrader cell metadata into the course notebooks, from their solution markers "
                    "and check calls (only cell metadata changes).")
    parser.add_argument("paths", nargs="+", help="notebooks, or folders of notebooks (e.g. notebooks/)")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 and name every cell whose metadata differs")
    args = parser.parse_args(argv)
    try:
        notebooks = _notebooks(args.paths)
        if args.check:
            problems = [line for path in notebooks for line in differences(path)]
            for line in problems:
                print(line)
            if problems:
                print(f"\nrun: python -m course_lib.classroom.nbgrader_metadata {' '.join(args.paths)}", file=sys.stderr)
            return 1 if problems else 0
        for path in notebooks:
            changed = apply(path)
            print(f"{path}: {'updated ' + str(changed) + ' cell(s)' if changed else 'up to date'}")
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
