"""The one reader of notebooks and of the code students write in them.

Collection (notebook 08), grading, learner copies and nbgrader's metadata all read notebooks
through this module, so that they agree on:

- the solution markers: ``### BEGIN SOLUTION (Exercise X.Y: what to write)`` and
  ``### END SOLUTION``, each alone on its line, indentation allowed (:func:`marker`);
- which cell is an exercise's, and which name it defines (:func:`exercise_cells`,
  :func:`find_cell`);
- what a student's definition needs to run (:func:`student_definition`): the ``def``/``class``
  of the exercise cell, the imports of that cell, and what the definition names from the
  student's other top-level code (helpers, helpers of helpers, imports, constants, of earlier
  cells or of the same cell), followed transitively. Names the course provides (``known``) are
  left to the course's version, as the notebooks do after each exercise.

Nothing here runs a student's code: it is only parsed.
"""
from __future__ import annotations

import ast
import builtins
import io
import os
import re
import symtable
import tokenize
from dataclasses import dataclass

import nbformat

__all__ = ["Marker", "ExerciseCell", "Definition", "marker", "looks_like_marker", "marked_exercises",
           "unfinished_exercises", "read_cells", "cells_from_text", "segment", "without_magics",
           "exercise_cells", "find_cell", "student_definition"]

# The markers, exactly: alone on their line, indentation allowed. The text in brackets names the
# exercise ("Exercise 2.2: write MaskedAttention.forward"); learner copies accept a BEGIN without it.
_BEGIN_RE = re.compile(r"^(?P<indent>[ \t]*)### BEGIN SOLUTION(?:[ \t]*\((?P<text>.*)\))?[ \t]*$")
_END_RE = re.compile(r"^(?P<indent>[ \t]*)### END SOLUTION[ \t]*$")
_EXERCISE_RE = re.compile(r"^[ \t]*Exercise[ \t]+(?P<id>\d+\.\d+)\b")
# Anything a human would read as a marker; checked after the exact forms so that typos are refused.
_LOOKALIKE_RE = re.compile(r"^[ \t]*#+[ \t]*(?P<kind>BEGIN|END)[ \t_]+SOLUTION\b", re.IGNORECASE)
# What a learner copy's unfinished exercise raises (see course_lib.classroom.assignments).
_UNFINISHED_RE = re.compile(r"raise NotImplementedError\(\s*[\"']Exercise (?P<id>\d+\.\d+)")
_MAGIC_RE = re.compile(r"^(?P<indent>[ \t]*)[%!].*$")

# What parsing a student's code may raise: a syntax error, or a "parse bomb" (nesting so deep that the
# parser runs out of stack or memory); either way that code is not taken, and nothing else fails.
_UNPARSABLE = (SyntaxError, ValueError, RecursionError, MemoryError)
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


# ---------------------------------------------------------------------------------------- markers

@dataclass(frozen=True)
class Marker:
    """One marker line: ``kind`` "begin" or "end", its indentation, and (BEGIN) the bracketed text."""

    kind: str
    indent: str
    text: str | None = None       # "Exercise 2.2: write ..." (None: a BEGIN without brackets, or END)
    exercise: str | None = None   # "2.2" when the text names an exercise


def marker(line: str) -> Marker | None:
    """The marker on ``line`` (its line ending ignored), or None when the line is not exactly one."""
    line = line.rstrip("\r\n")
    begin = _BEGIN_RE.match(line)
    if begin:
        named = _EXERCISE_RE.match(begin["text"] or "")
        return Marker("begin", begin["indent"], begin["text"], named["id"] if named else None)
    end = _END_RE.match(line)
    return Marker("end", end["indent"]) if end else None


def looks_like_marker(line: str) -> str | None:
    """"begin" or "end" when a reader would take ``line`` for a marker (``## begin solution``, or
    ``### BEGIN SOLUTION`` followed by other words), whether or not it is one exactly."""
    found = _LOOKALIKE_RE.match(line)
    return found["kind"].lower() if found else None


def marked_exercises(source: str) -> list[str]:
    """The exercises the BEGIN markers of a cell name, in order."""
    found = (marker(line) for line in source.splitlines())
    return [m.exercise for m in found if m is not None and m.kind == "begin" and m.exercise]


def unfinished_exercises(source: str) -> set[str]:
    """The exercises whose learner-copy ``raise NotImplementedError("Exercise X.Y ...")`` is in ``source``."""
    return set(_UNFINISHED_RE.findall(source))


# ------------------------------------------------------------------------------------------ cells

def read_cells(path: str | os.PathLike) -> list:
    """The cells of the notebook at ``path``."""
    return nbformat.read(path, as_version=4).cells


def cells_from_text(text: str) -> list:
    """The cells of a notebook given as its JSON text."""
    return nbformat.reads(text, as_version=4).cells


def segment(source: str, node: ast.stmt) -> str:
    """The source of one statement, decorators included (ast's own segment starts at ``def``)."""
    lines = source.splitlines()
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "\n".join(lines[first - 1:node.end_lineno])


def _at_statement_start(lines: list[str]) -> bool:
    """True when ``lines`` end between statements (not inside brackets, a string or after a backslash)."""
    try:
        for _ in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
            pass
    except (tokenize.TokenError, SyntaxError):
        return False   # EOF inside a bracket, a string or a backslash continuation
    return True


def without_magics(source: str) -> str:
    """IPython's ``%magic`` and ``!shell`` lines replaced by ``pass`` (same indentation), so a cell
    that runs in Jupyter also parses here; nothing of them is run. A line is a magic only where a
    statement starts: ``!= b`` or ``% n`` continuing an expression is Python, as IPython runs it."""
    lines = source.splitlines(keepends=True)
    out: list[str] = []
    for line in lines:
        match = _MAGIC_RE.match(line.rstrip("\r\n"))
        if match and _at_statement_start(out):
            out.append(f"{match['indent']}pass" + ("\n" if line.endswith("\n") else ""))
        else:
            out.append(line)
    return "".join(out)


@dataclass(frozen=True)
class ExerciseCell:
    """An exercise cell of a course notebook: the name it defines and the course's definition."""

    id: str
    name: str
    notebook: str     # the notebook's file name, "03_multi_head_attention.ipynb"
    cell_id: str
    solution: str     # the cell's imports and definitions, as source
    alone: bool       # True when the cell defines only ``name`` (False: 9.2's helpers beside it)


def exercise_cells(cells: list, notebook: str = "") -> list[ExerciseCell]:
    """The exercise cells among ``cells`` (of the course notebook named ``notebook``): each cell with a BEGIN marker naming
    an exercise and one definition that is the exercise's. That is the cell's only ``def``/``class``,
    or, where it defines several (9.2's ``rotate_half`` and ``apply_rotary``), the one holding the
    marker; the others are its helpers. A cell defining nothing (1.1's numbers) is left out."""
    found = []
    for cell in cells:
        ids = marked_exercises(cell.source) if cell.cell_type == "code" else []
        if not ids:
            continue
        tree = ast.parse(cell.source)
        definitions = [n for n in tree.body if isinstance(n, _DEFINITIONS)]
        if len(definitions) > 1:
            at = next(i for i, line in enumerate(cell.source.splitlines(), 1)
                      if (m := marker(line)) is not None and m.exercise == ids[0])
            definitions = [n for n in definitions if n.lineno <= at <= n.end_lineno]
        if len(definitions) != 1:
            continue
        kept = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, *_DEFINITIONS))]
        alone = sum(isinstance(n, _DEFINITIONS) for n in tree.body) == 1
        found.append(ExerciseCell(ids[0], definitions[0].name, notebook, cell.get("id", ""),
                                  "\n\n".join(segment(cell.source, n) for n in kept), alone))
    return found


# where a definition counts, for the message that says none was found
TOP_LEVEL = ("at its top level (a `def` or `class` of that name, or a lambda assigned to it, outside any if, loop "
             "or function)")


def _is_definition(node: ast.stmt, name: str) -> bool:
    """``node`` defines ``name``: a ``def``/``class`` of that name, or ``name = lambda ...`` (a function too)."""
    if isinstance(node, _DEFINITIONS):
        return node.name == name
    return isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda) and \
        any(isinstance(target, ast.Name) and target.id == name for target in node.targets)


def _defines(source: str, name: str) -> bool:
    """True when the cell defines ``name`` at its top level (``def``/``class``, or a lambda assigned to it)."""
    try:
        tree = ast.parse(without_magics(source))
    except _UNPARSABLE:
        return bool(re.search(rf"^(class|def)\s+{re.escape(name)}\b", source, re.M))   # reported as not compiling
    return any(_is_definition(n, name) for n in tree.body)


def find_cell(cells: list, name: str, cell_id: str) -> tuple[int | None, bool]:
    """The index of the student's cell for an exercise defining ``name``, and whether it moved: the
    exercise's own cell (``cell_id``, the course's id) while it defines the name; else the last
    cell of the notebook that does (moved: True); else the own cell (None when there is none)."""
    own = next((i for i, cell in enumerate(cells) if cell.cell_type == "code" and cell.get("id") == cell_id), None)
    if own is not None and _defines(cells[own].source, name):
        return own, False
    matches = [i for i, cell in enumerate(cells) if cell.cell_type == "code" and _defines(cell.source, name)]
    if not matches:
        return own, False
    return matches[-1], own is not None


# ------------------------------------------------------------------------- a student's definition

@dataclass(frozen=True)
class Definition:
    """What was found for one name: ``source`` to run, or ``problem`` saying why there is none.

    ``problem``: "no_cell" (no cell defines the name), "syntax" (the cell does not compile; ``detail``
    says where), "too_deep" (nested beyond what Python can compile), "not_defined" (the exercise's
    cell no longer defines the name). ``cell``: the index of the cell read; ``moved``: True when that
    is not the exercise's own cell.
    """

    source: str | None
    cell: int | None = None
    moved: bool = False
    problem: str | None = None
    detail: str = ""


def student_definition(cells: list, name: str, cell_id: str, known: set[str]) -> Definition:
    """The student's definition of ``name`` with everything it needs, in notebook order.

    ``cell_id``: the course's id of the exercise cell. ``known``: the names the course provides
    wherever the definition runs (never taken from the student's other code).
    """
    index, moved = find_cell(cells, name, cell_id)
    if index is None:
        return Definition(None, problem="no_cell")
    cell_source = without_magics(cells[index].source)
    try:
        ast.parse(cell_source)
    except SyntaxError as err:
        return Definition(None, index, moved, "syntax", f"SyntaxError, line {err.lineno}: {err.msg}")
    except (RecursionError, MemoryError, ValueError) as err:
        return Definition(None, index, moved, "too_deep", type(err).__name__)
    statements = _statements(cells, index)
    own = [s for s in statements if s.position[0] == index]
    definitions = [s for s in own if name in s.binds and _is_definition(s.node, name)]
    if not definitions:
        return Definition(None, index, moved, "not_defined")
    chosen = {s.position for s in definitions}
    chosen |= {s.position for s in own if isinstance(s.node, (ast.Import, ast.ImportFrom))}
    try:
        chosen |= _needed(definitions, [s for s in statements if s.position not in chosen], known | {name})
    except _UNPARSABLE:
        pass   # code symtable cannot read alone: the definition and its cell's imports only
    return Definition("\n\n".join(s.source for s in statements if s.position in chosen), index, moved)


def _bound_names(node: ast.stmt) -> set[str]:
    """The top-level names one statement binds (imports, definitions, plain assignments)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {alias.asname or alias.name.split(".")[0] for alias in node.names if alias.name != "*"}
    if isinstance(node, _DEFINITIONS):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
    names: set[str] = set()
    for target in targets:
        elements = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
        if not all(isinstance(e, ast.Name) for e in elements):
            return set()   # x[0] = ..., obj.attr = ...: changes something, binds nothing we follow
        names |= {e.id for e in elements}
    return names


def _global_names(source: str) -> set[str]:
    """The global names a piece of code reads (in function and class bodies, decorators, bases and
    defaults), less the names it binds itself and the builtins."""
    table = symtable.symtable(source, "<part>", "exec")
    found: set[str] = set()
    bound = {sym.get_name() for sym in table.get_symbols() if sym.is_assigned() or sym.is_imported()}

    def walk(scope: symtable.SymbolTable) -> None:
        for sym in scope.get_symbols():
            top = scope.get_type() == "module"
            if sym.is_referenced() and (top or sym.is_global()):
                found.add(sym.get_name())
        for child in scope.get_children():
            walk(child)

    walk(table)
    return found - bound - set(dir(builtins))


@dataclass(frozen=True)
class _Statement:
    position: tuple[int, int]   # (cell, statement) in the notebook
    source: str
    binds: frozenset[str]
    node: ast.stmt


def _statements(cells: list, upto: int) -> list[_Statement]:
    """The top-level statements of code cells ``0..upto`` (inclusive) that parse."""
    found = []
    for index, cell in enumerate(cells[:upto + 1]):
        if cell.cell_type != "code":
            continue
        source = without_magics(cell.source)
        try:
            tree = ast.parse(source)
        except _UNPARSABLE:
            continue   # a broken cell elsewhere (or a parse bomb) is not this exercise's problem
        found += [_Statement((index, i), segment(source, node), frozenset(_bound_names(node)), node)
                  for i, node in enumerate(tree.body)]
    return found


def _value_reads(node: ast.stmt) -> set[str]:
    """The names an assignment's value reads (its own target's included, unlike :func:`_global_names`)."""
    value = getattr(node, "value", None) if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
    if value is None:
        return set()
    return {n.id for n in ast.walk(value) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - \
        set(dir(builtins))


def _needed(definitions: list[_Statement], others: list[_Statement], known: set[str]) -> set[tuple[int, int]]:
    """The positions of the statements the definitions need: for each global name they read, the last
    statement binding it, then what that one reads, and so on."""
    chosen: set[tuple[int, int]] = set()
    todo = [(name, None) for name in set().union(*(_global_names(s.source) for s in definitions)) - known]
    seen: set[tuple[str, tuple[int, int] | None]] = set()
    while todo:
        name, before = todo.pop()
        binders = [] if (name, before) in seen else \
            [s for s in others if name in s.binds and (before is None or s.position < before)]
        seen.add((name, before))
        if binders and binders[-1].position not in chosen:
            binder = binders[-1]
            chosen.add(binder.position)
            reads = (_global_names(binder.source) | _value_reads(binder.node)) - known
            # ``f = f if ok(f) else g`` reads the f bound before it: follow that one too
            todo += [(n, binder.position if n in binder.binds else None) for n in reads]
        if not todo:   # (whichever name came last) a definition that registers itself on one of those (@f.register
            # def _): needed by f
            bound = set().union(*(s.binds for s in [*others, *definitions] if s.position in chosen | {
                d.position for d in definitions} and not isinstance(s.node, (ast.Import, ast.ImportFrom))))
            for registers in (s for s in others if s.position not in chosen and _decorated_by(s.node, bound)):
                chosen.add(registers.position)
                todo += [(n, None) for n in (_global_names(registers.source) - known)]
    return chosen


def _decorated_by(node: ast.stmt, names: set[str]) -> bool:
    """Whether a def or class is decorated by an attribute of one of ``names`` (``@handlers.register``), names the
    student's own code defines (not a module: ``@torch.no_grad()`` ties nothing to the definition)."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return False
    return any(isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id in names
               for decorator in node.decorator_list for part in ast.walk(decorator))
