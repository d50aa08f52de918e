"""Old import paths of the modules that moved into ``course_lib.classroom``: a student's own copy of a
notebook, written before the move and never overwritten, keeps importing what it imported.

``from course_lib.collect import collect_student_parts`` finds the module at its new path and hands
that very module back (not a copy), so its names, classes and state are the ones the course uses.
Nothing of the classroom loads until an old path is asked for: the reference still imports none of it.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

# old path -> new path (a package's submodules follow it: course_lib.grading.cli -> ...grading.cli)
MOVED = {f"course_lib.{name}": f"course_lib.classroom.{name}"
         for name in ("checks", "grading", "collect", "assignments", "copy_policy", "nbgrader_metadata",
                      "capstone", "progress", "doctor")}


def new_path(fullname: str) -> str | None:
    """Where the module once imported as ``fullname`` lives now, or None if it never moved."""
    for old, new in MOVED.items():
        if fullname == old or fullname.startswith(old + "."):
            return new + fullname[len(old):]
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None   # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module: ModuleType) -> None:
        # the import system returns whatever sys.modules holds under the name after this call
        sys.modules[module.__name__] = importlib.import_module(self.target)


class MovedModules(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        moved = new_path(fullname)
        return importlib.util.spec_from_loader(fullname, _Alias(moved)) if moved else None


def install() -> None:
    # first in line: under an old package name (course_lib.grading) the path finder would otherwise load
    # a second copy of a submodule (course_lib.grading.cli) from the moved package's folder
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
