"""Whether a student's part is the course's solution, copied: the same code once names are normalised.

Copying a solution the course shows is a teaching matter, not a failed exercise: the grader flags
such a part for the instructor (``grades.csv``'s ``flag``, ``summary.md``) and grades it as usual.
Two definitions are the same when their syntax trees are, after docstrings are dropped and every
name (variables, arguments, helper functions and classes) is renamed in order of first appearance;
attribute names (``self.query``), constants and the structure must match. The worker compares
fingerprints (:func:`fingerprint`): it receives the solution's, never the solution.
"""
from __future__ import annotations

import ast
import hashlib

__all__ = ["fingerprint", "FLAG_SAME_AS_SOLUTION"]

FLAG_SAME_AS_SOLUTION = "same as the course's solution"


class _Renamer(ast.NodeTransformer):
    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def _name(self, name: str) -> str:
        return self.names.setdefault(name, f"v{len(self.names)}")

    def visit_Name(self, node: ast.Name) -> ast.AST:
        node.id = self._name(node.id)
        return node

    def visit_arg(self, node: ast.arg) -> ast.AST:
        node.arg = self._name(node.arg)
        self.generic_visit(node)
        return node

    def _definition(self, node: ast.AST) -> ast.AST:
        node.name = self._name(node.name)
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]   # the docstring says nothing about the code
        self.generic_visit(node)
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _definition


def fingerprint(source: str | None, name: str) -> str | None:
    """A digest of the top-level ``def``/``class`` named ``name`` in ``source``, names normalised; None
    where there is no such definition (or the source does not parse)."""
    if not source or not name:
        return None
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    found = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
             and node.name == name]
    if not found:
        return None
    try:
        normal = _Renamer().visit(found[-1])
        dumped = ast.dump(normal, annotate_fields=False, include_attributes=False)
    except RecursionError:
        return None
    return hashlib.sha256(dumped.encode("utf-8")).hexdigest()
