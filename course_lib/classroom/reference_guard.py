"""While an exercise is checked, the course's own version of it is out of the student's reach.

Each check hands the student's code a world where the course's reference of every exercise is
one name away (the notebooks carry on with it after each exercise). A definition that only calls
it (``def causal_mask(n, _course=causal_mask): return _course(n)``), subclasses it
(``class MaskedAttention(MaskedAttention): pass``) or is it (``from course_lib.attention import
causal_mask``) would pass without being the student's work. :func:`guard` refuses that, in the
notebooks' checks and in the grader alike (the harness of ``checks`` runs every checker in it):

- before the check: the student's candidate wraps the reference, or subclasses it and inherits the work
  (a subclass that writes its own forward on the given constructor is judged like any code; the reference itself
  is the course's known-good answer in its own tests; the grader refuses a student's name bound to it);
- during the check: the reference's own code starts running while the student's code is on the
  stack between it and the checker (a profile hook that watches only the reference's code objects).

Either way the check ends with :class:`CallsReference`, which the harness turns into the verdict
``calls_reference`` with a message saying what the exercise asks for instead. The checker's own
calls of the reference (to compare against it) run as before. This is a guard against the easy
ways, not a wall: a student can still copy the reference's text, which the grader flags apart.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import sysconfig
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

__all__ = ["CallsReference", "guard", "exercise_names", "reference_of", "is_reference", "message"]

# Where the course's references live, searched in this order for an exercise's name.
_REFERENCE_MODULES = ("attention", "model", "modern", "modern_gpt", "generate", "data", "train", "flash", "heads",
                      "variants")


class CallsReference(BaseException):
    """The student's code handed the work to the course's own version of the exercise. A BaseException,
    so that ``except Exception`` in the student's code cannot swallow it."""

    def __init__(self, exercise: str, name: str, how: str):
        self.exercise, self.name, self.how = exercise, name, how
        super().__init__(f"{how} the course's own {name}")


@functools.lru_cache(maxsize=1)
def exercise_names() -> dict[str, str]:
    """Exercise id -> the name its cell defines, read once from the course's notebooks ({} where they
    cannot be read: then nothing is guarded, and nothing fails)."""
    try:
        from ..course_files import course_notebooks
        from . import notebook_reader as reader
        return {cell.id: cell.name for path in course_notebooks()
                for cell in reader.exercise_cells(reader.read_cells(path))}
    except Exception:  # a broken installation: the checks still run, unguarded
        return {}


@functools.cache
def reference_of(exercise: str) -> Any:
    """The course's own object for ``exercise`` (a function or a class), or None."""
    name = exercise_names().get(exercise)
    if not name:
        return None
    for module_name in _REFERENCE_MODULES:
        try:
            module = importlib.import_module(f"course_lib.{module_name}")
        except Exception:  # an optional module that cannot load here
            continue
        found = getattr(module, name, None)
        if callable(found) and getattr(found, "__module__", "").startswith("course_lib."):
            return found
    return None


def _own_code(function: Any) -> CodeType | None:
    """The code of ``function`` itself, under its decorators (``torch.no_grad()`` wraps many), if it is the course's."""
    try:
        function = inspect.unwrap(function)
    except ValueError:   # a cycle of __wrapped__
        return None
    code = getattr(function, "__code__", None)
    if isinstance(code, CodeType) and "course_lib" in code.co_filename.replace("\\", "/").split("/"):
        return code
    return None


def _codes(reference: Any) -> frozenset[CodeType]:
    """The code objects that are the reference's own work: the function's, or the methods a class defines."""
    # a class's constructor is left out: the exercise cell gives it, so super().__init__() reuses no work
    values = ([value for name, value in vars(reference).items() if name != "__init__"]
              if isinstance(reference, type) else [reference])
    found = set()
    for value in values:
        value = getattr(value, "__func__", value)   # staticmethod, classmethod
        if isinstance(value, property):
            value = value.fget
        code = _own_code(value)
        if code is not None:
            found.add(code)
    return frozenset(found)


def _work(reference: type) -> set[str]:
    """The names of the methods a reference class defines that do its work: all but the constructor and
    the other special methods (every defined function, should it have no other)."""
    defined = set()
    for name, value in vars(reference).items():
        value = getattr(value, "__func__", value)   # staticmethod, classmethod
        if isinstance(value, property):
            value = value.fget
        if _own_code(value) is not None:
            defined.add(name)
    work = {name for name in defined if not (name.startswith("__") and name.endswith("__"))}
    return work or (defined - {"__init__"})


def _overrides_the_work(candidate: type, reference: type) -> bool:
    """Whether a class between ``candidate`` and ``reference`` in the MRO defines one of the reference's work methods."""
    above = candidate.__mro__[:candidate.__mro__.index(reference)]
    codes = _codes(reference)
    for klass in above:
        for name in _work(reference) & set(vars(klass)):
            value = getattr(vars(klass)[name], "__func__", vars(klass)[name])
            code = _own_code(value.fget if isinstance(value, property) else value)
            if code is None or code not in codes:   # not the reference's method set on the subclass by name
                return True
    return False


def is_reference(candidate: Any, reference: Any) -> str | None:
    """How ``candidate`` is the reference without being the student's code: "is", "subclasses", "wraps",
    "is a copy of", or None when it is not."""
    if candidate is reference:
        return "is"
    if isinstance(reference, type) and isinstance(candidate, type) and issubclass(candidate, reference):
        # A subclass that writes the work itself (its own forward, say, on the constructor the exercise
        # gives) is the student's code; one that inherits all of it is not. Its calls of the reference's
        # methods are caught while it runs (``_Guard``).
        return None if _overrides_the_work(candidate, reference) else "subclasses"
    inner = candidate
    for _ in range(10):   # functools.partial, functools.wraps, bound methods
        inner = getattr(inner, "func", None) or getattr(inner, "__wrapped__", None) or getattr(inner, "__func__", None)
        if inner is None:
            break
        if inner is reference:
            return "wraps"
    code = _own_code(candidate) if callable(candidate) and not isinstance(candidate, type) else None
    if code is not None and code in _codes(reference):
        return "is a copy of"
    return None


@functools.lru_cache(maxsize=4096)
def _student_file(filename: str) -> bool:
    """Whether code from ``filename`` is the student's: not the course's, torch's, or an installed library's."""
    name = filename.replace("\\", "/")
    if "/course_lib/" in name or "/torch/" in name or name.startswith("<frozen"):
        return False
    if not os.path.isabs(filename):
        return True   # "<your 02_masked_attention.ipynb, Exercise 2.1>", "<string>", an IPython cell
    real = os.path.realpath(filename).replace("\\", "/")
    return not real.startswith(_library_prefixes())


@functools.lru_cache(maxsize=1)
def _library_prefixes() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[key]).replace("\\", "/") + "/" for key in ("stdlib", "purelib", "platlib")
                  if paths.get(key)})


_DEPTH = [0]   # guards entered and not left: a checker the checker itself calls is not guarded again


class _Guard:
    def __init__(self, exercise: str, reference: Any):
        self.exercise, self.reference = exercise, reference
        self.stop: FrameType | None = None
        self.codes = _codes(reference)
        self.name = getattr(reference, "__name__", "the reference")
        self.tripped: CallsReference | None = None
        self.previous: Callable | None = None

    def _hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code not in self.codes:
            return
        caller = frame.f_back
        while caller is not None and caller is not self.stop:
            if caller.f_code not in self.codes and _student_file(caller.f_code.co_filename):
                self.tripped = CallsReference(self.exercise, self.name, "calls")
                raise self.tripped
            caller = caller.f_back

    def __enter__(self) -> _Guard:
        _DEPTH[0] += 1
        self.previous = sys.getprofile()
        self.stop = sys._getframe(1)   # the checker's harness: the student's code is what runs above it
        if self.codes:
            sys.setprofile(self._hook)
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        sys.setprofile(self.previous)
        _DEPTH[0] -= 1
        if self.tripped is not None and exc is not self.tripped:   # their code swallowed it: the verdict stands
            raise self.tripped


class _NoGuard:
    def __enter__(self) -> _NoGuard:
        _DEPTH[0] += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _DEPTH[0] -= 1


def guard(exercise: str, args: tuple, kwargs: dict) -> _Guard | _NoGuard:
    """A context for checking ``exercise`` on the candidate in ``args``/``kwargs``: raises
    :class:`CallsReference` at once when the candidate is the reference, wraps or subclasses it, and
    when the reference runs from the student's code inside the context (the student's code on the
    stack between the reference and the frame that entered the context)."""
    reference = reference_of(exercise) if not _DEPTH[0] else None   # inside a check: the outer guard holds
    if reference is None:
        return _NoGuard()
    # A checker's first argument is the student's work. The reference itself is let through here: the
    # course's tests and demonstrations check it as the known-good answer; the grader refuses a student's
    # name bound to it (``grading.judge``).
    how = is_reference(args[0], reference) if args else None
    if how and how != "is":
        raise CallsReference(exercise, getattr(reference, "__name__", "reference"), how)
    return _Guard(exercise, reference)


def message(found: CallsReference, asks: str = "") -> str:
    """The verdict's message: what the code did, and what the exercise asks for instead."""
    did = {"is": f"is the course's own {found.name}", "subclasses": f"subclasses the course's own {found.name}",
           "wraps": f"wraps the course's own {found.name}", "is a copy of": f"is the course's own {found.name}",
           "calls": f"calls the course's own {found.name}"}.get(found.how, f"uses the course's own {found.name}")
    what = f" ({asks})" if asks else ""
    return (f"Your code {did} instead of doing the work itself. Exercise {found.exercise} asks you to write "
            f"{found.name} yourself{what}: replace the call with your own computation, then re-run the check.")
