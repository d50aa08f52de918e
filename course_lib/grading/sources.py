"""A student's definition of each exercise, read from their notebook without running any of it.

For one exercise this takes, from the student's notebook, the ``def``/``class`` of the exercise
cell (found by the course's cell id, else the last cell defining the exercise's name), the
imports of that cell, and what the definition names from the student's other top-level code:
helper functions and classes, imports and plain assignments of earlier cells or of the same cell,
followed transitively. Names the course itself provides there (``causal_mask``, ``GPTConfig``,
``torch``, ...) are left to the course's version, as the notebooks do after each exercise.

Nothing here executes the student's code: it only parses it. An unfinished exercise (the learner
copy's ``raise NotImplementedError``) is kept as it is, so that the checker gives it its own
verdict (``not_implemented``), never a pass from the course's solution.
"""
from __future__ import annotations

import ast
import builtins
import re
import symtable
from dataclasses import dataclass

import nbformat

from ..collect import _segment
from .plan import ExercisePlan

__all__ = ["StudentPart", "find_notebook", "student_part"]

_MAGIC_RE = re.compile(r"^(?P<indent>[ \t]*)[%!].*$", re.M)


@dataclass(frozen=True)
class StudentPart:
    """What was found for one exercise: ``source`` to run, or why there is nothing to run."""

    exercise: str
    source: str | None             # the definition with what it needs, in notebook order
    diagnosis: str | None = None   # when there is nothing to run: "missing" or "exception"
    message: str = ""


def find_notebook(names: list[str], notebook: str) -> tuple[str | None, str]:
    """The student's file for the course notebook ``notebook``: the same name, else the one file
    starting with the same two-digit number ("02_masked_attention (1).ipynb"). Returns the name
    (or None) and, when none is used, why."""
    if notebook in names:
        return notebook, ""
    number = notebook[:2]
    alike = sorted(name for name in names if name.endswith(".ipynb") and re.match(rf"{number}\D", name))
    if len(alike) == 1:
        return alike[0], ""
    if alike:
        return None, f"several notebooks could be {notebook} ({', '.join(alike)}); hand in one"
    return None, f"no {notebook} in the submission"


def _without_magics(source: str) -> str:
    """IPython's ``%magic`` and ``!shell`` lines replaced by ``pass`` (same indentation), so a cell
    that runs in Jupyter also parses here; nothing of them is run."""
    return _MAGIC_RE.sub(lambda m: f"{m['indent']}pass", source)


def _bound_names(node: ast.stmt) -> set[str]:
    """The top-level names one statement binds (imports, definitions, plain assignments)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {alias.asname or alias.name.split(".")[0] for alias in node.names if alias.name != "*"}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
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
        source = _without_magics(cell.source)
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue   # a broken cell elsewhere is not this exercise's problem
        found += [_Statement((index, i), _segment(source, node), frozenset(_bound_names(node)), node)
                  for i, node in enumerate(tree.body)]
    return found


def _find_cell(cells: list, plan: ExercisePlan) -> int | None:
    for index, cell in enumerate(cells):
        if cell.cell_type == "code" and cell.get("id") == plan.cell_id:
            return index
    pattern = re.compile(rf"^(class|def)\s+{re.escape(plan.name)}\b", re.M)
    matches = [i for i, cell in enumerate(cells) if cell.cell_type == "code" and pattern.search(cell.source)]
    return matches[-1] if matches else None


def student_part(notebook_text: str | None, plan: ExercisePlan, known: set[str], *,
                 missing_detail: str = "") -> StudentPart:
    """The student's definition for ``plan`` from the notebook's text (None: no such notebook).

    ``known``: the names the course provides to every exercise (never taken from the student's
    other code). ``missing_detail`` says why there is no notebook.
    """
    if notebook_text is None:
        return StudentPart(plan.id, None, "missing", missing_detail or f"no {plan.notebook} in the submission")
    try:
        cells = nbformat.reads(notebook_text, as_version=4).cells
    except Exception as err:  # the student's file: anything unreadable is a missing exercise
        return StudentPart(plan.id, None, "missing", f"{plan.notebook} cannot be read as a notebook "
                                                      f"({type(err).__name__}: {str(err)[:200]})")
    index = _find_cell(cells, plan)
    if index is None:
        return StudentPart(plan.id, None, "missing", f"no cell of {plan.notebook} defines {plan.name}")
    cell_source = _without_magics(cells[index].source)
    try:
        ast.parse(cell_source)
    except SyntaxError as err:
        return StudentPart(plan.id, None, "exception",
                           f"Your cell defining {plan.name} does not compile (SyntaxError, line {err.lineno}: "
                           f"{err.msg}). Fix it, run the cell, then save the notebook.")
    statements = _statements(cells, index)
    own = [s for s in statements if s.position[0] == index]
    definitions = [s for s in own if plan.name in s.binds
                   and isinstance(s.node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    if not definitions:
        return StudentPart(plan.id, None, "missing", f"the exercise cell no longer defines {plan.name}")
    chosen = {s.position for s in definitions}
    chosen |= {s.position for s in own if isinstance(s.node, (ast.Import, ast.ImportFrom))}
    try:
        chosen |= _needed(definitions, [s for s in statements if s.position not in chosen], known | {plan.name})
    except (SyntaxError, ValueError):
        pass   # code symtable cannot read alone: the definition and its cell's imports, as collect takes them
    source = "\n\n".join(s.source for s in statements if s.position in chosen)
    return StudentPart(plan.id, source)


def _needed(definitions: list[_Statement], others: list[_Statement], known: set[str]) -> set[tuple[int, int]]:
    """The positions of the statements the definitions need: for each global name they read, the last
    statement binding it, then what that one reads, and so on."""
    chosen: set[tuple[int, int]] = set()
    wanted = set().union(*(_global_names(s.source) for s in definitions)) - known
    seen: set[str] = set()
    while wanted - seen:
        name = min(wanted - seen)
        seen.add(name)
        binders = [s for s in others if name in s.binds]
        if binders and binders[-1].position not in chosen:
            chosen.add(binders[-1].position)
            wanted |= _global_names(binders[-1].source) - known
    return chosen
