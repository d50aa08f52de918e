"""Train once, replay after, for the notebook tests (course_lib/train_replay.py says how and why).

The Makefile's notebook targets put this folder on PYTHONPATH, so every Python they start (nbval's
kernels among them) runs this file first. With COURSE_TRAIN_RECORD or COURSE_TRAIN_REPLAY set, it
wraps the course's training entry points right after their modules are executed, before any notebook
imports their names; without them it does nothing. It imports nothing itself until the course is
imported, so a kernel starts as fast as without it.
"""
import importlib.abc
import importlib.util
import os
import sys

_MODULES = ("course_lib.train", "course_lib.heads", "course_lib.classroom.capstone")


class _WrapAfterExec(importlib.abc.MetaPathFinder):
    """Finds the entry points' modules as the normal finders do, and runs the wrapper after them."""

    def find_spec(self, name, path=None, target=None):
        if name not in _MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        from course_lib import train_replay  # course_lib is being imported already
        train_replay.wrap_module(module)

    def __getattr__(self, name):   # get_source, get_code, is_package... as the real loader has them
        return getattr(self.loader, name)


if os.environ.get("COURSE_TRAIN_RECORD") or os.environ.get("COURSE_TRAIN_REPLAY"):
    sys.meta_path.insert(0, _WrapAfterExec())

# Python imports one sitecustomize: run the one this folder hides (a distribution's own), if any.
_here = os.path.dirname(os.path.abspath(__file__))
for _folder in sys.path:
    if _folder and os.path.abspath(_folder) != _here:
        _other = os.path.join(_folder, "sitecustomize.py")
        if os.path.isfile(_other):
            _spec = importlib.util.spec_from_file_location("_hidden_sitecustomize", _other)
            try:
                _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
            except Exception:   # a distribution's hook failing must not stop the tests' kernels
                pass
            break
