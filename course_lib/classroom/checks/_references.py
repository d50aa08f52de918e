"""course_lib as it was when ``checks`` was imported: what every check runs against.

A student's notebook may patch a reference (``course_lib.attention.causal_mask = ...``). While a
check runs, and again after each call into the student's code, course_lib is put back to these
pinned attributes, so a patch can neither make a wrong answer pass nor a right one fail. The
run (``engine.run``) saves the student's own attributes before a check and restores them after.
"""
from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any


def attributes() -> dict[Any, dict[str, Any]]:
    """Every course_lib module's and class's attributes, by object."""
    spaces: dict[Any, dict[str, Any]] = {}
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "course_lib" or name.startswith("course_lib.")):
            spaces[module] = dict(vars(module))
            spaces.update({v: dict(vars(v)) for v in vars(module).values()
                           if isinstance(v, type) and getattr(v, "__module__", None) == module.__name__})
    return spaces


def is_submodule(obj: Any, value: Any, name: str) -> bool:
    """Whether ``obj.name`` is ``value`` as Python binds a submodule it imports: a module of that name, the one in
    sys.modules, from a file of the package's own folder (a module object made under that name is not)."""
    if not (isinstance(obj, ModuleType) and isinstance(value, ModuleType) and value.__name__ == f"{obj.__name__}.{name}"
            and sys.modules.get(value.__name__) is value):
        return False
    return any(os.path.isfile(os.path.join(folder, name + ".py")) or
               os.path.isfile(os.path.join(folder, name, "__init__.py")) for folder in getattr(obj, "__path__", ()))


def restore_namespace(obj: Any, saved: dict[str, Any]) -> None:
    current = vars(obj)
    for name in [n for n in current if n not in saved]:
        if is_submodule(obj, current[name], name):
            # a submodule imported during the check (course_lib.classroom.progress) stays bound, as Python left it,
            # and is pinned from now on (no file looked for again after each call of the student's code)
            saved[name] = current[name]
            continue
        try:
            delattr(obj, name)
        except (AttributeError, TypeError):
            pass
    for name, value in saved.items():
        if name not in current or current[name] is not value:
            try:
                setattr(obj, name, value)
            except (AttributeError, TypeError):
                pass   # read-only slots such as __dict__ never differ


_PRISTINE: dict[Any, dict[str, Any]] = {}


def bind_references(*, checkers_too: bool = False) -> None:
    """Remember course_lib as it is now (called when ``checks`` is imported): checks run against it.

    The checkers' own modules are left out: they are not references a notebook imports, and tests
    inject faults into them (they are still restored after every check, like all of course_lib). The
    grader pins them too (``checkers_too``), in the process that runs one submission, before its code runs:
    there a ``setattr`` on the engine would be the submission writing its own verdict."""
    for obj, saved in attributes().items():
        owner = obj.__name__ if isinstance(obj, ModuleType) else getattr(obj, "__module__", "")
        # A module still being imported (one that imports checks at its top) holds only part of its
        # names yet: pinning that half would strip the rest during every check.
        initializing = isinstance(obj, ModuleType) and getattr(obj.__spec__, "_initializing", False)
        if (checkers_too or not owner.startswith("course_lib.classroom.checks")) and not initializing:
            _PRISTINE.setdefault(obj, saved)


def pinned_attribute(module: ModuleType, name: str) -> Any:
    """``module.name`` as pinned, whatever a notebook has bound to that name since (None if it has none)."""
    bind_references()   # a module imported just now is pinned as it is
    return _PRISTINE.get(module, vars(module)).get(name)


def pinned_state() -> tuple[tuple[Any, str, Any], ...]:
    """Every pinned name as (its namespace, the name, the pinned value): what the grader compares the course with
    after putting it back."""
    return tuple((vars(space), name, value) for space, saved in _PRISTINE.items() for name, value in saved.items())


def install_references() -> None:
    """Put course_lib back as it was when checks was imported (the student's patches are saved)."""
    for obj, saved in _PRISTINE.items():
        restore_namespace(obj, saved)

