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
import io
import re
import symtable
import tokenize
from dataclasses import dataclass

import nbformat

from ..collect import _UNFINISHED_RE, _segment
from .plan import ExercisePlan

__all__ = ["StudentPart", "candidates", "find_notebook", "unfinished_exercises", "student_part"]

_MAGIC_RE = re.compile(r"^(?P<indent>[ \t]*)[%!].*$")


# What parsing a student's code may raise: a syntax error, or a "parse bomb" (nesting so deep that the
# parser runs out of stack or memory); either way that code is not taken, and nothing else fails.
_UNPARSABLE = (SyntaxError, ValueError, RecursionError, MemoryError)


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
        cells = nbformat.reads(notebook_text, as_version=4).cells
    except Exception:  # the student's file: anything unreadable
        return 1 << 20
    return len({m for cell in cells if cell.cell_type == "code" for m in _UNFINISHED_RE.findall(cell.source)})


def _at_statement_start(lines: list[str]) -> bool:
    """True when ``lines`` end between statements (not inside brackets, a string or after a backslash)."""
    try:
        for _ in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
            pass
    except (tokenize.TokenError, SyntaxError):
        return False   # EOF inside a bracket, a string or a backslash continuation
    return True


def _without_magics(source: str) -> str:
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
        except _UNPARSABLE:
            continue   # a broken cell elsewhere (or a parse bomb) is not this exercise's problem
        found += [_Statement((index, i), _segment(source, node), frozenset(_bound_names(node)), node)
                  for i, node in enumerate(tree.body)]
    return found


def _defines(source: str, name: str) -> bool:
    """True when the cell defines ``name`` at its top level (``def``/``class``)."""
    try:
        tree = ast.parse(_without_magics(source))
    except _UNPARSABLE:
        return bool(re.search(rf"^(class|def)\s+{re.escape(name)}\b", source, re.M))   # reported as not compiling
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name
               for n in tree.body)


def _find_cell(cells: list, plan: ExercisePlan) -> tuple[int | None, str]:
    """The cell to grade and a note: the exercise's own cell (by the course's cell id) while it
    defines the name; else the last cell of the notebook that does, and the note says so."""
    own = next((i for i, cell in enumerate(cells) if cell.cell_type == "code" and cell.get("id") == plan.cell_id),
               None)
    if own is not None and _defines(cells[own].source, plan.name):
        return own, ""
    matches = [i for i, cell in enumerate(cells) if cell.cell_type == "code" and _defines(cell.source, plan.name)]
    if not matches:
        return own, ""
    if own is None:
        return matches[-1], ""
    return matches[-1], (f"(Graded your definition of {plan.name} in code cell {_code_number(cells, matches[-1])}: "
                         f"the exercise's own cell no longer defines it.)")


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
        cells = nbformat.reads(notebook_text, as_version=4).cells
    except Exception as err:  # the student's file: anything unreadable is a missing exercise
        return StudentPart(plan.id, None, "missing", f"{plan.notebook} cannot be read as a notebook "
                                                      f"({type(err).__name__}: {str(err)[:200]})")
    index, note = _find_cell(cells, plan)
    if index is None:
        return StudentPart(plan.id, None, "missing", f"no cell of {plan.notebook} defines {plan.name}")
    cell_source = _without_magics(cells[index].source)
    try:
        ast.parse(cell_source)
    except SyntaxError as err:
        return StudentPart(plan.id, None, "exception",
                           f"Your cell defining {plan.name} does not compile (SyntaxError, line {err.lineno}: "
                           f"{err.msg}). Fix it, run the cell, then save the notebook.")
    except (RecursionError, MemoryError, ValueError) as err:
        return StudentPart(plan.id, None, "exception",
                           f"Your cell defining {plan.name} is too deeply nested for Python to compile "
                           f"({type(err).__name__}). Simplify it, run the cell, then save the notebook.")
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
    except _UNPARSABLE:
        pass   # code symtable cannot read alone: the definition and its cell's imports, as collect takes them
    source = "\n\n".join(s.source for s in statements if s.position in chosen)
    return StudentPart(plan.id, source, note=note)


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
        if (name, before) in seen:
            continue
        seen.add((name, before))
        binders = [s for s in others if name in s.binds and (before is None or s.position < before)]
        if binders and binders[-1].position not in chosen:
            binder = binders[-1]
            chosen.add(binder.position)
            reads = (_global_names(binder.source) | _value_reads(binder.node)) - known
            # ``f = f if ok(f) else g`` reads the f bound before it: follow that one too
            todo += [(n, binder.position if n in binder.binds else None) for n in reads]
    return chosen
