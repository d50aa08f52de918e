"""Learner copies of the notebooks: solutions stripped, outputs cleared.

Marker convention (notebook authors follow this exactly)
---------------------------------------------------------
In a *code* cell, the solution sits between two comment lines::

    ### BEGIN SOLUTION (Exercise 2.2: write MaskedAttention.forward)
    ...solution...
    ### END SOLUTION

* Each marker is alone on its line, spelled exactly ``### BEGIN SOLUTION`` /
  ``### END SOLUTION`` (nbgrader's markers: with the cell metadata that
  ``course_lib.classroom.nbgrader_metadata`` writes, nbgrader grades the notebooks too);
  leading indentation is allowed and should match the code the region
  replaces, because the replacement is written at the BEGIN marker's
  indentation.
* The BEGIN marker may carry ``(Exercise X.Y: what to write)``, and must for
  ``course_lib.classroom.nbgrader_metadata`` (the course's notebooks do). Without it,
  the label comes from the nearest ``# Exercise X.Y: what to write`` comment
  line above the marker in the same cell, then from ``exercise_hint``, else
  ``"Exercise: write this part"``. A marker text without an id
  (``(write the forward pass)``) borrows the id of that comment line.
* Regions cannot nest; every BEGIN needs its END in the same cell. Lines that
  look like a marker but are not spelled exactly (``## BEGIN SOLUTION``,
  ``### begin solution``, text without parentheses) are refused rather than
  left in place, so a typo can never leak a solution.

Each region becomes, at the BEGIN marker's indentation::

    # YOUR CODE HERE: write MaskedAttention.forward
    raise NotImplementedError("Exercise 2.2: write MaskedAttention.forward")

A function whose body is a region still compiles and can be defined; only
calling it raises, which the checkers report as ``not_implemented``. Markdown
and raw cells are never changed. Cells are counted from 1 in error messages,
markdown cells included.
"""
from __future__ import annotations

import argparse
import ast
import errno
import json
import os
import re
import shlex
import sys
from pathlib import Path

import nbformat

from .. import _validate as validate
from .._validate import describe
from . import notebook_reader as reader  # the solution markers, as every tool reads them
from .copy_policy import CopyOutcome, place_learner_copy

__all__ = ["strip_solutions", "learner_notebook", "make_learner_copy", "make_learner_copies", "update_learner_copies",
           "main", "start_main"]

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
DEFAULT_LABEL = "Exercise: write this part"

_EXERCISE_COMMENT_RE = re.compile(r"^[ \t]*#[ \t]*(?P<text>Exercise[ \t]+\d+(?:\.\d+)*[a-z]?\b.*?)[ \t]*$")
_LABEL_RE = re.compile(r"^Exercise[ \t]+(?P<id>\d+(?:\.\d+)*[a-z]?)\b[ \t]*:?[ \t]*(?P<what>.*)$")

# Cell metadata written by tools that know the solution (solution flags of exercise extensions) or by
# the run that produced the cleared outputs. nbgrader's entry is kept unless nbgrader itself wrote it
# (see _keeps_nbgrader_metadata).
_REVEALING_CELL_METADATA = ("solution", "solution2", "solution2_first", "execution")
# Notebook metadata that stores output state (saved ipywidgets), cleared along with the outputs.
_OUTPUT_NOTEBOOK_METADATA = ("widgets",)


def _where(cell_label: str, line: int | None = None) -> str:
    parts = [p for p in (cell_label, f"line {line}" if line is not None else "") if p]
    return ", ".join(parts) or "cell"


def _parse_label(text: str) -> tuple[str | None, str]:
    """Split 'Exercise 2.2: what' into ('2.2', 'what'); plain text gives (None, text)."""
    text = text.strip()
    match = _LABEL_RE.match(text)
    if match:
        return match["id"], match["what"].strip()
    return None, text


def _label(marker_text: str | None, comment: str | None, exercise_hint: str | None) -> tuple[str, str]:
    """The (full label, what to write) for one region, by the precedence in the module docstring."""
    parsed = [_parse_label(t) for t in (marker_text, comment, exercise_hint) if t and t.strip()]
    ex_id = next((found_id for found_id, _ in parsed if found_id), None)
    # A description written for another exercise must not be borrowed.
    what = next((found_what for found_id, found_what in parsed
                 if found_what and found_id in (None, ex_id)), "write this part")
    return (f"Exercise {ex_id}: {what}" if ex_id else f"Exercise: {what}"), what


def _split_lines(source: str) -> list[str]:
    # Only "\n" ends a line (as in Python source); each piece keeps its ending so that
    # joining the untouched pieces gives back the original bytes.
    return [piece for piece in re.split(r"(?<=\n)", source) if piece]


def _ending(line: str) -> str:
    return line[len(line.rstrip("\r\n")):]


def _compiles(source: str) -> str | None:
    """None when ``source`` compiles as a notebook cell, else the SyntaxError text."""
    try:  # notebooks may hold magics (%time, !pip) that only IPython understands
        from IPython.core.inputtransformer2 import TransformerManager
        source = TransformerManager().transform_cell(source)
    except Exception:  # without IPython, plain Python is the best test we have
        pass
    try:
        compile(source, "<cell>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except SyntaxError as err:
        return f"line {err.lineno}: {err.msg}"
    return None


def _strip(source: str, exercise_hint: str | None, cell_label: str) -> tuple[str, list[str]]:
    """Replace every solution region; returns the new source and one label per region."""
    lines = _split_lines(source)
    out: list[str] = []
    labels: list[str] = []
    comment: str | None = None
    open_at: int | None = None
    begin: reader.Marker | None = None

    for number, line in enumerate(lines, start=1):
        text = line.rstrip("\r\n")
        found = reader.marker(text)
        begin_match = found if found is not None and found.kind == "begin" else None
        end_match = found if found is not None and found.kind == "end" else None
        if begin_match:
            if open_at is not None:
                raise ValueError(f"{_where(cell_label, number)}: nested '{BEGIN}' inside the region "
                                 f"opened at line {open_at}; close that region with '{END}' first")
            open_at, begin = number, begin_match
            continue
        if end_match:
            if open_at is None:
                raise ValueError(f"{_where(cell_label, number)}: '{END}' without a matching "
                                 f"'{BEGIN}' above it in the same cell")
            full, what = _label(begin.text, comment, exercise_hint)
            indent, newline = begin.indent, _ending(line) or "\n"
            out.append(f"{indent}# YOUR CODE HERE: {what}{newline}")
            # json gives a valid, escaped Python string literal with the house double quotes
            out.append(f"{indent}raise NotImplementedError({json.dumps(full, ensure_ascii=False)})"
                       f"{_ending(line)}")
            labels.append(full)
            open_at, begin = None, None
            continue
        if reader.looks_like_marker(text):
            raise ValueError(f"{_where(cell_label, number)}: {text.strip()!r} looks like a solution marker "
                             f"but is not one; expected exactly '{BEGIN}' (optionally followed by "
                             f"'(Exercise X.Y: what to write)') or '{END}', alone on the line")
        if open_at is None:
            comment_match = _EXERCISE_COMMENT_RE.match(text)
            if comment_match:
                comment = comment_match["text"]
            out.append(line)

    if open_at is not None:
        raise ValueError(f"{_where(cell_label, open_at)}: '{BEGIN}' without a matching '{END}' "
                         f"below it in the same cell")
    stripped = "".join(out)
    if labels and _compiles(source) is None:
        problem = _compiles(stripped)
        if problem is not None:
            raise ValueError(f"{_where(cell_label)}: the learner copy of this cell would not compile "
                             f"({problem}); indent each '{BEGIN}' like the code it replaces")
    return stripped, labels


def strip_solutions(source: str, exercise_hint: str | None = None, cell_label: str = "") -> str:
    """Replace each ``### BEGIN/END SOLUTION`` region of a code cell by a ``NotImplementedError``."""
    if not isinstance(source, str):
        raise TypeError(f"source: expected the code cell's source as a str, got {describe(source)}")
    if exercise_hint is not None and not isinstance(exercise_hint, str):
        raise TypeError(f"exercise_hint: expected a str such as 'Exercise 2.2: write forward' or None, "
                        f"got {describe(exercise_hint)}")
    if not isinstance(cell_label, str):
        raise TypeError(f"cell_label: expected a str naming the cell for error messages, "
                        f"got {describe(cell_label)}")
    return _strip(source, exercise_hint, cell_label)[0]


def learner_notebook(notebook_path: Path) -> tuple[nbformat.NotebookNode, dict[str, int]]:
    """Read one notebook and return its learner version (in memory) with counts."""
    if not notebook_path.is_file():
        raise FileNotFoundError(f"notebook_path: expected an existing .ipynb file, got '{notebook_path}'"
                                + (" (a folder)" if notebook_path.is_dir() else " (not found)"))
    try:
        nb = nbformat.read(notebook_path, as_version=4)
    except Exception as err:  # any parse failure means the same thing to the user
        raise ValueError(f"notebook_path: could not read '{notebook_path}' as a Jupyter notebook "
                         f"({type(err).__name__}: {err})") from err

    labels: list[str] = []
    code_cells = 0
    for index, cell in enumerate(nb.cells, start=1):
        if cell.cell_type != "code":
            continue
        code_cells += 1
        cell.source, found = _strip(cell.source, None, f"notebook {notebook_path.name}, cell {index}")
        labels.extend(found)
        cell.outputs = []
        cell.execution_count = None
        for key in _REVEALING_CELL_METADATA:
            cell.metadata.pop(key, None)
        if "nbgrader" in cell.metadata and not _keeps_nbgrader_metadata(cell.metadata["nbgrader"]):
            del cell.metadata["nbgrader"]
    for key in _OUTPUT_NOTEBOOK_METADATA:
        nb.metadata.pop(key, None)

    named = {label.split(":", 1)[0] for label in labels if not label.startswith("Exercise:")}
    unnamed = sum(label.startswith("Exercise:") for label in labels)
    counts = {"regions": len(labels), "exercises": len(named) + unnamed,
              "cells": len(nb.cells), "code_cells": code_cells}
    return nb, counts


def _keeps_nbgrader_metadata(entry: object) -> bool:
    """The source metadata of course_lib.classroom.nbgrader_metadata travels into the learner copy, so that nbgrader
    can autograde a copy made by `course_lib start` too. An entry with a checksum was written by nbgrader
    itself (a release or a submission, for its own gradebook) and is dropped, like anything malformed."""
    return isinstance(entry, dict) and "checksum" not in entry


def _same_path(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
        return a.resolve() == b.resolve()
    except OSError:
        return False


def make_learner_copy(notebook_path: str | os.PathLike, out_path: str | os.PathLike) -> dict[str, int]:
    """Write the learner copy of one notebook; returns counts (regions, exercises, cells, code_cells).

    A copy at ``out_path`` that the student edited is never overwritten: the new version is
    written beside it (see ``course_lib.classroom.copy_policy``).
    """
    src, dst = validate.path("notebook_path", notebook_path), validate.path("out_path", out_path)
    if _same_path(src, dst):
        raise ValueError(f"out_path: expected a different file from notebook_path, got '{dst}' for both; "
                         f"writing there would overwrite the solutions")
    nb, counts = learner_notebook(src)
    place_learner_copy(nb, dst, note=_summary(counts))
    return counts


def _source_notebooks(src_dir: Path) -> list[Path]:
    return sorted(p for p in src_dir.glob("*.ipynb")
                  if p.is_file() and not p.name.startswith(".") and not p.stem.endswith("-checkpoint"))


def _check_dirs(src_dir: Path, out_dir: Path) -> None:
    if not src_dir.is_dir():
        raise FileNotFoundError(f"src_dir: expected an existing folder of notebooks, got '{src_dir}'"
                                + (" (a file)" if src_dir.exists() else " (not found)"))
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"out_dir: expected a folder (it is created if missing), "
                                 f"got '{out_dir}', which is a file")
    if _same_path(src_dir, out_dir):
        raise ValueError(f"out_dir: expected a folder other than src_dir, got '{out_dir}' for both; "
                         f"the learner copies would overwrite the solution notebooks")


def update_learner_copies(src_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[CopyOutcome]:
    """Write or refresh the learner copy of every ``*.ipynb`` directly in ``src_dir`` in ``out_dir``.

    Copies the student edited are kept; the new version goes beside them. Returns one
    ``CopyOutcome`` per notebook, in teaching order, saying what was done.
    """
    src, out = validate.path("src_dir", src_dir), validate.path("out_dir", out_dir)
    _check_dirs(src, out)
    # Strip everything before writing anything: one bad marker leaves out_dir untouched.
    prepared = [(out / path.name, *learner_notebook(path)) for path in _source_notebooks(src)]
    out.mkdir(parents=True, exist_ok=True)
    return [place_learner_copy(nb, dst, note=_summary(counts)) for dst, nb, counts in prepared]


def make_learner_copies(src_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Like ``update_learner_copies``; returns the file holding each notebook's new learner version."""
    return [outcome.written for outcome in update_learner_copies(src_dir, out_dir)]


def _summary(counts: dict[str, int]) -> str:
    exercises, regions = counts["exercises"], counts["regions"]
    text = f"{exercises} exercise{'' if exercises == 1 else 's'}"
    if regions != exercises:
        text += f", {regions} solution region{'' if regions == 1 else 's'}"
    return text


def _arguments_or_exit_code(parser: argparse.ArgumentParser, argv: list[str] | None,
                            command: str) -> argparse.Namespace | int:
    if argv is not None and (isinstance(argv, str) or not all(isinstance(a, str) for a in argv)):
        print(f"error: argv: expected a list of str (the arguments after '{command}'), "
              f"got {describe(argv)}", file=sys.stderr)
        return 2
    try:
        return parser.parse_args(argv)
    except SystemExit as exit_:  # usage errors and --help: argparse has already printed
        return exit_.code if isinstance(exit_.code, int) else 2


def _write_and_report(src_dir: Path, out_dir: Path) -> list[CopyOutcome] | None:
    """Write the copies and print one line per notebook; None (after printing why) on failure."""
    try:
        _check_dirs(src_dir, out_dir)
        if not _source_notebooks(src_dir):
            raise FileNotFoundError(f"src_dir: expected a folder containing *.ipynb notebooks, "
                                    f"got '{src_dir}', which has none")
        outcomes = update_learner_copies(src_dir, out_dir)
    except (ValueError, TypeError, OSError) as err:
        if isinstance(err, OSError) and err.errno == errno.ENAMETOOLONG:   # a copy is staged under a longer name
            print(f"error: src_dir: a notebook's name is too long to write a copy of ({err.filename or out_dir}); "
                  f"rename it shorter (a copy is written under its name plus about 25 characters first)",
                  file=sys.stderr)
        elif isinstance(err, OSError) and err.errno is not None:   # the file system's answer, not one of our checks
            print(f"error: out_dir: could not read or write {err.filename or out_dir} ({err.strerror or err}); "
                  f"make room, or choose a folder you can write", file=sys.stderr)
        else:
            print(f"error: {err}", file=sys.stderr)
        return None
    except RuntimeError as err:   # pathlib's "Symlink loop from ..." (a RuntimeError before Python 3.13)
        if "Symlink loop" not in str(err):
            raise
        print(f"error: {err}; expected a folder (or a path that does not exist yet), not a link that "
              f"points back to itself", file=sys.stderr)
        return None
    for outcome in outcomes:
        print(outcome.line())
    return outcomes


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib student SRC OUT``; ``argv`` is the arguments after ``student``."""
    parser = argparse.ArgumentParser(
        prog="python -m course_lib student",
        description="Write learner copies of the notebooks: each '### BEGIN SOLUTION' ... "
                    "'### END SOLUTION' region becomes a NotImplementedError naming the exercise; "
                    "outputs are cleared. A copy you edited is never overwritten: the new version "
                    "is written beside it as NAME.updated.ipynb.")
    parser.add_argument("src", help="folder with the solution notebooks (e.g. notebooks/)")
    parser.add_argument("out", help="folder for the learner copies (created; must differ from SRC)")
    args = _arguments_or_exit_code(parser, argv, "student")
    if isinstance(args, int):
        return args
    folders = _folders_or_none(src=args.src, out=args.out)
    if folders is None:
        return 2
    return 0 if _write_and_report(folders["src"], folders["out"]) is not None else 2


def _folders_or_none(expand: bool = False, **given: str) -> dict[str, Path] | None:
    """The command line's folders as Paths, or None after printing why: an empty string would be Path(''), the
    current folder, silently written into (grade, progress and export refuse it so too)."""
    folders = {}
    for name, value in given.items():
        try:
            folders[name] = validate.path(name, value, "a folder")
            if expand:   # start's DIR: "~/course" quoted still means the home folder
                folders[name] = folders[name].expanduser()
        except (ValueError, TypeError) as err:
            print(f"error: {err}", file=sys.stderr)
            return None
        except RuntimeError as err:   # pathlib's expanduser: "Could not determine home directory" (~nouser)
            print(f"error: {name}: expected a folder, got {value!r} ({err})", file=sys.stderr)
            return None
    return folders


DEFAULT_START_DIR = "attention-course"


def start_main(argv: list[str] | None = None) -> int:
    """``python -m course_lib start [DIR]``: your own copies of the course, from the installed package."""
    parser = argparse.ArgumentParser(
        prog="python -m course_lib start",
        description="Write your own copies of the course notebooks (exercises left for you) into DIR. "
                    "Run it again after updating the course: copies you edited are kept as they are, "
                    "and the new version is written beside them as NAME.updated.ipynb.")
    parser.add_argument("dir", nargs="?", default=DEFAULT_START_DIR,
                        help=f"folder for your copies (default: ./{DEFAULT_START_DIR})")
    args = _arguments_or_exit_code(parser, argv, "start")
    if isinstance(args, int):
        return args
    from ..course_files import notebooks_dir
    try:
        source = notebooks_dir()
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    folders = _folders_or_none(expand=True, dir=args.dir)
    if folders is None:
        return 2
    out_dir = folders["dir"]
    outcomes = _write_and_report(source, out_dir)
    if outcomes is None:
        return 2
    first = outcomes[0].path if outcomes else out_dir
    print(f"\nYour copies are in {out_dir.resolve()}. Open the first notebook with\n"
          f"    jupyter lab {shlex.quote(str(first))}\n"
          f"or, on a JupyterHub or a hosted notebook, open {first} from the file browser.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
