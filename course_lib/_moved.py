"""The shim for old import paths, removed in the release after 2027-06-30.

Only for a student's own copy of a notebook written before ``checks``, ``capstone``, ``collect`` and
the others moved into ``course_lib.classroom`` and ``course_lib.runs`` (a copy the student edited is
never overwritten). The course's notebooks, their learner copies and the package itself import every
name from where it lives (``from course_lib.classroom import checks``), and tests/test_layout.py fails
if any of them goes through this module, the one place allowed to hook imports.

``from course_lib import checks`` or ``from course_lib.collect import collect_student_parts`` finds the
module at its new path and hands that very module back (not a copy), so its names, classes and state
are the ones the course uses. A name that left a module which still exists
(``from course_lib.train import PRESETS``) is fetched from where it lives now: the finder gives
``course_lib.train`` and ``course_lib.model`` a module ``__getattr__`` as they load, so the files
students read hold only the lesson. Nothing moved loads until an old path or name is asked for, so
the reference still imports nothing of the classroom or the runs.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

# old path -> new path (a package's submodules follow it: course_lib.grading.cli -> ...grading.cli)
MOVED = {f"course_lib.{name}": f"course_lib.classroom.{name}"
         for name in ("checks", "grading", "collect", "assignments", "copy_policy", "nbgrader_metadata",
                      "capstone", "progress", "doctor")}
MOVED |= {f"course_lib.{name}": f"course_lib.runs.{name}"
          for name in ("presets", "run_folder", "stopping", "bench", "ablation")}
MOVED["course_lib.hf.export"] = "course_lib.runs.export"

# module -> {old name: "new.module" or "new.module:new_name"}: names that left a module that stays
MOVED_NAMES = {
    "course_lib.train": {**dict.fromkeys(("PRESETS", "Preset", "prepare_preset", "run_preset"),
                                         "course_lib.runs.presets"),
                         **dict.fromkeys(("Split", "TokenStream", "Examples"), "course_lib.data"),
                         "_batches": "course_lib.train:batches", "_update": "course_lib.train:update"},
    "course_lib.model": {**dict.fromkeys(("ModernGPT", "ModernGPTConfig", "ModernBlock"), "course_lib.modern_gpt"),
                         "check_vocabulary": "course_lib._validate:in_vocabulary"},
}


def forwarder(module_name: str):
    """A module's ``__getattr__``: the names that left it, fetched from where they live now."""
    moved = MOVED_NAMES.get(module_name, {})

    def __getattr__(name: str) -> object:
        if name not in moved:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        where, _, new_name = moved[name].partition(":")
        return getattr(importlib.import_module(where), new_name or name)
    return __getattr__


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


class _WithOldNames(importlib.abc.Loader):
    """Loads a module as its own loader would, then lets it answer the names that left it."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def __getattr__(self, name: str) -> object:   # get_source, get_filename, ...: the real loader's
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        module.__getattr__ = forwarder(module.__name__)


class MovedModules(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._finding: set[str] = set()   # a finder after us that asks every finder again gets None

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        moved = new_path(fullname)
        if moved:
            return importlib.util.spec_from_loader(fullname, _Alias(moved))
        if fullname not in MOVED_NAMES or fullname in self._finding:
            return None
        # the module as the finders after this one find it (another hook, such as the notebook tests'
        # train replay, keeps its turn), then its old names on top
        self._finding.add(fullname)
        try:
            spec = next((found for finder in sys.meta_path if finder is not self and hasattr(finder, "find_spec")
                         for found in [finder.find_spec(fullname, path, target)] if found is not None), None)
        finally:
            self._finding.discard(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _WithOldNames(spec.loader)
        return spec


def install() -> None:
    # first in line: under an old package name (course_lib.grading) the path finder would otherwise load
    # a second copy of a submodule (course_lib.grading.cli) from the moved package's folder; and before
    # course_lib.model loads, so that it gets its old names
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
