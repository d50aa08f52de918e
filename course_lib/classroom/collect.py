"""Collecting a student's own parts from their saved learner copies, to use them together.

Each exercise of the course defines one name (``causal_mask``, ``GPT``, ``train_step``, ...) in one code
cell. ``collect_student_parts(folder)`` takes, for every exercise, only that definition with what it needs,
read by ``notebook_reader.student_definition`` exactly as the grader reads it. Nothing else from those
notebooks runs: no prints, no training cells, no checks.

An exercise that is missing, unfinished (still raises the learner copy's
``NotImplementedError``) or broken (does not compile, or fails to define its name) falls back
to the course's solution, and ``Collection.table()`` says so.

``Collection.namespace(yours)`` executes the definitions in one fresh namespace, the student's
for the exercises in ``yours`` and the solution's for the rest, so parts compose by name as in
the notebooks: a ``GPT`` built there uses the ``TransformerBlock`` defined there, which uses
that namespace's ``MultiHeadMaskedAttention``, whose mask comes from its ``causal_mask``.
"""
from __future__ import annotations

import ast
import builtins
import functools
import linecache
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import _validate as validate
from .._validate import describe
from ..course_files import course_notebooks
from . import notebook_reader as reader

WITHHELD = "withheld by the grader"   # what a solution says in the grader's sandbox (grading.stubs)

__all__ = ["CollectedPart", "Collection", "every_exercise", "course_exercises", "collect_student_parts",
           "course_namespace", "course_names", "GPT_EXERCISES"]

# The exercises a GPT of your own is built and trained from, in the order they compose.
GPT_EXERCISES = ("2.1", "3.1", "3.2", "3.3", "4.2", "4.3", "5.2", "5.3", "5.4")

# Notebook 04's GPT cell builds its blocks from ``ReferenceBlock`` (the tested block), so that an
# unfinished 4.2 cannot break 4.3. Put together, your GPT is built from the block defined beside it.
ALIASES = {"ReferenceBlock": "TransformerBlock"}

STATUS_TEXT = {
    "yours": "yours",
    "missing": "course's (yours is missing)",
    "unfinished": "course's (yours is not written yet)",
    "broken": "course's (yours does not run)",
}


@dataclass(frozen=True)
class CollectedPart:
    """What was found for one exercise in the student's notebooks."""

    exercise: reader.ExerciseCell
    status: str               # a key of STATUS_TEXT
    source: str | None = None  # the student's definitions (with their helpers and imports), when usable
    detail: str = ""          # why it fell back, for the table

    @property
    def is_yours(self) -> bool:
        return self.status == "yours"

    @property
    def is_the_solution(self) -> bool:
        """True when the student's part is the course's solution up to comments and layout."""
        if not self.is_yours:
            return False
        try:
            return ast.dump(ast.parse(self.source)) == ast.dump(ast.parse(self.exercise.solution))
        except SyntaxError:
            return False


def every_exercise(notebooks: Iterable[Path] | None = None) -> dict[str, reader.ExerciseCell]:
    """Every exercise cell of the solution notebooks, by id (1.1's defines only numbers: not one)."""
    return {cell.id: cell for path in (course_notebooks() if notebooks is None else _notebook_paths(notebooks))
            for cell in reader.exercise_cells(reader.read_cells(path), Path(path).name)}


def _notebook_paths(notebooks: Any) -> list[Path]:
    """``notebooks`` as a list of existing .ipynb files, else an error naming the argument."""
    if isinstance(notebooks, (str, os.PathLike)) or not isinstance(notebooks, Iterable):
        raise TypeError(f"notebooks: expected a list of notebook paths, got {describe(notebooks)}")
    paths = [validate.path("notebooks", each, "a notebook (.ipynb) of the course") for each in notebooks]
    for path in paths:
        if path.suffix != ".ipynb" or not path.is_file():
            raise FileNotFoundError(f"notebooks: expected existing .ipynb files, got '{path}' "
                                    f"({'not a notebook' if path.is_file() else 'not found'})")
    return paths


def course_exercises(notebooks: Iterable[Path] | None = None) -> dict[str, reader.ExerciseCell]:
    """The exercises whose cell defines one name, by id (9.2's cell also defines a helper: not collected)."""
    return {ex_id: cell for ex_id, cell in every_exercise(notebooks).items() if cell.alone}


@functools.lru_cache(maxsize=4)
def _exercise_names(notebooks: tuple[Path, ...]) -> tuple[str, ...]:
    """The name every exercise cell of the course defines, 9.2's (beside a helper) included."""
    return tuple(cell.name for cell in every_exercise(notebooks).values())


def _collect_one(folder: Path, exercise: reader.ExerciseCell, known: set[str]) -> CollectedPart:
    path = folder / exercise.notebook
    if not path.is_file():
        return CollectedPart(exercise, "missing", detail=f"no {exercise.notebook} in {folder}")
    try:
        cells = reader.read_cells(path)
    except Exception as err:  # a notebook we cannot read is a missing part, not a crash
        return CollectedPart(exercise, "missing", detail=f"{exercise.notebook} cannot be read ({err})")
    found = reader.student_definition(cells, exercise.name, exercise.cell_id, known)
    if found.problem == "no_cell":
        return CollectedPart(exercise, "missing", detail=f"no cell defines {exercise.name}")
    if reader.unfinished_exercises(cells[found.cell].source):
        return CollectedPart(exercise, "unfinished", detail="still raises NotImplementedError")
    if found.problem == "syntax":
        return CollectedPart(exercise, "broken", detail=found.detail)
    if found.problem == "too_deep":
        return CollectedPart(exercise, "broken", detail=f"too deeply nested to compile ({found.detail})")
    if found.problem == "not_defined":
        return CollectedPart(exercise, "missing", detail=f"the exercise cell no longer defines {exercise.name} {reader.TOP_LEVEL}")
    return CollectedPart(exercise, "yours", found.source)


def _base_namespace() -> dict:
    """What every exercise cell may name: torch, and the course's version of every building block."""
    import math

    import torch
    import torch.nn.functional as F  # the name every notebook uses
    from torch import nn

    from .. import attention, data, generate, model, train
    namespace = {"__name__": "course_parts", "__builtins__": builtins, "math": math, "torch": torch, "nn": nn,
                 "F": F}
    # The course's versions of everything a cell may name; an exercise that is not collected
    # (or whose definition is executed later) resolves to these, as in the notebooks.
    for module, names in ((attention, ("scaled_dot_product_attention", "causal_mask", "split_heads",
                                       "merge_heads", "MaskedAttention", "MultiHeadMaskedAttention")),
                          (model, ("FeedForward", "GPTConfig", "LearnedPositionalEncoding",
                                   "SinusoidalPositionalEncoding", "sinusoidal_table", "TransformerBlock", "GPT")),
                          (data, ("lm_windows",)), (train, ("lm_loss", "train_step")),
                          (generate, ("sample_next_token",))):
        namespace.update({name: getattr(module, name) for name in names})
    return namespace


def course_namespace() -> dict:
    """What a student's definition runs in, in notebook 08's collection and in the grader alike:
    torch, ``nn``, ``F``, ``math``, the course's building blocks, and the course's version of every
    other exercise's name (``modern.apply_rotary`` for 9.6, ...), as the notebooks carry on with the
    course's version after each exercise."""
    from .. import attention, generate, model, modern
    namespace = _base_namespace()
    for name in _exercise_names(tuple(course_notebooks())):
        for module in (modern, attention, model, generate):
            if name not in namespace and hasattr(module, name):
                namespace[name] = getattr(module, name)
    namespace.setdefault("modern", modern)
    for alias, target in ALIASES.items():
        namespace[alias] = namespace[target]
    return namespace


def course_names() -> set[str]:
    """The names the course provides wherever a student's definition runs: never taken from the
    student's other code (``checks``: the course's checkers, in every notebook)."""
    return (set(_exercise_names(tuple(course_notebooks()))) | set(course_namespace()) | set(ALIASES)
            | {"checks"})


def execute_student_source(source: str, namespace: dict, label: str) -> None:
    """Run the student's own definitions in ``namespace`` as their notebook did: no __future__ import of the
    course's applies to them (``dont_inherit``; annotations stay objects for a @dataclass), and their source is
    in ``linecache`` under ``label`` (what IPython does for a cell), so that inspect.getsource and
    torch.jit.script find it."""
    linecache.cache[label] = (len(source), None, source.splitlines(keepends=True), label)
    exec(compile(source, label, "exec", dont_inherit=True), namespace)


class Collection:
    """The parts collected from one folder of learner copies, by exercise id."""

    def __init__(self, folder: Path, parts: dict[str, CollectedPart]) -> None:
        self.folder = folder
        self.parts = parts

    def yours(self) -> list[str]:
        """The ids of the exercises whose part is the student's."""
        return [ex_id for ex_id, part in self.parts.items() if part.is_yours]

    def namespace(self, yours: Iterable[str] | None = None) -> dict:
        """A fresh namespace with every part defined: the student's for ``yours`` (default: all
        usable ones), the course's solution for the rest."""
        chosen = set(self.yours() if yours is None else yours)
        unknown = chosen - set(self.parts)
        if unknown:
            raise ValueError(f"yours: expected exercise ids among {sorted(self.parts)}, got {sorted(unknown)}")
        not_usable = sorted(ex_id for ex_id in chosen if not self.parts[ex_id].is_yours)
        if not_usable:
            raise ValueError(f"yours: exercises {not_usable} have no usable part of yours "
                             f"({'; '.join(self.parts[i].detail for i in not_usable)})")
        namespace = course_namespace()
        for ex_id, part in self.parts.items():
            for alias, target in ALIASES.items():
                if target in namespace:
                    namespace[alias] = namespace[target]
            if ex_id in chosen:
                execute_student_source(part.source, namespace, f"<your {part.exercise.notebook}, Exercise {ex_id}>")
            elif WITHHELD not in part.exercise.solution:
                execute_student_source(part.exercise.solution, namespace, f"<course solution, Exercise {ex_id}>")
            # else: the grader's sandbox, whose notebooks hold no solution: course_namespace()'s own version
            # (course_lib's, which the solution equals) stands for it under the same name
        return namespace

    def with_part(self, exercise_id: str, source: str) -> Collection:
        """A copy of this collection whose part for ``exercise_id`` is ``source`` (to try a variant)."""
        if exercise_id not in self.parts:
            raise ValueError(f"exercise_id: expected one of {sorted(self.parts)}, got {exercise_id!r}")
        if not isinstance(source, str):
            raise TypeError(f"source: expected the definition's source code as a str, got {describe(source)}")
        try:
            compile(source, f"<Exercise {exercise_id}>", "exec")
        except SyntaxError as err:
            raise ValueError(f"source: does not compile (line {err.lineno}: {err.msg})") from None
        parts = dict(self.parts)
        parts[exercise_id] = CollectedPart(self.parts[exercise_id].exercise, "yours", source)
        return Collection(self.folder, parts)

    def table(self) -> str:
        """A plain-text table: each exercise, its name, and whose part is used."""
        rows = [("exercise", "name", "used", "why")]
        rows += [(ex_id, part.exercise.name, STATUS_TEXT[part.status], part.detail)
                 for ex_id, part in self.parts.items()]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}".rstrip()
                         for a, b, c, d in rows)

    def __repr__(self) -> str:
        return f"parts collected from {self.folder}:\n{self.table()}"


def collect_student_parts(folder: str | os.PathLike = ".", exercises: Iterable[str] = GPT_EXERCISES,
                          notebooks: Iterable[Path] | None = None) -> Collection:
    """Collect the student's parts for ``exercises`` from the learner copies in ``folder``.

    A part that is missing, unfinished or broken falls back to the course's solution. A part
    whose definition runs but raises when executed in the namespace is marked broken too.
    """
    root = validate.path("folder", folder, "the folder of your notebooks")
    if not root.is_dir():
        raise FileNotFoundError(f"folder: expected a folder holding your notebooks, got '{root}' "
                                f"({'a file' if root.exists() else 'not found'})")
    if isinstance(exercises, str) or not isinstance(exercises, Iterable):
        raise TypeError(f"exercises: expected a list of exercise ids such as ['2.1', '3.3'], got "
                        f"{describe(exercises)}")
    known = course_exercises(notebooks)
    wanted = list(exercises)
    unknown = [ex_id for ex_id in wanted if ex_id not in known]
    if unknown:
        raise ValueError(f"exercises: expected ids among {sorted(known)}, got {unknown}")
    names = course_names()
    parts = {ex_id: _collect_one(root, known[ex_id], names) for ex_id in wanted}
    collection = Collection(root, parts)
    # A definition that compiles may still fail when it runs (a bad decorator, a name that is
    # nowhere): try each of the student's parts once, alone among the course's.
    for ex_id in collection.yours():
        try:
            namespace = collection.namespace([ex_id])
            defined = namespace.get(parts[ex_id].exercise.name)
            if not callable(defined):
                raise TypeError(f"{parts[ex_id].exercise.name} is {describe(defined)}, not a function or class")
        except Exception as err:  # the student's code: any error means "does not run"
            parts[ex_id] = CollectedPart(parts[ex_id].exercise, "broken",
                                         detail=f"{type(err).__name__}: {err}")
    return collection
