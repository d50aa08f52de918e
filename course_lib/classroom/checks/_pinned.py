"""torch's own functions as the checks found them: one replaced by the student's code is a verdict of its own.

A check rests on torch's arithmetic (``torch.equal``, ``torch.allclose``, ``Tensor.__sub__``...) and runs the
course's references on torch's functions (``F.softmax``, ``nn.Linear.forward``). Code that replaces one of them
(``torch.equal = lambda *a: True``, even from a default argument evaluated when its cell runs) would make a
wrong answer pass, and leak into every later cell, where a right answer then fails. So every function that the
student's code can reach of torch, its tensors, its modules, ``math`` and the builtins is pinned when
``checks`` is imported (before any exercise cell runs, in the notebook and in the grader); a check that finds
one of them replaced, or one defined in the student's code, stops with the verdict ``patched`` before it
compares anything (``run``), and again after each call of the student's code (``_student_code.call``). The
course's own modules are pinned apart (``_references``).
"""
from __future__ import annotations

import builtins
import inspect
import math
import operator
import os
import sys
from collections.abc import Callable, Iterator
from types import FunctionType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..verdict import fail
from ._student_files import is_student_file


def _namespaces() -> Iterator[tuple[str, Any]]:
    """(the name a student writes, the object whose attributes are pinned)."""
    yield from (("torch", torch), ("torch.nn.functional", F), ("torch.Tensor", torch.Tensor),
                ("torch.Tensor", torch._C.TensorBase), ("torch.linalg", torch.linalg),
                ("torch.special", torch.special), ("torch.autograd", torch.autograd), ("torch.nn.init", nn.init),
                ("torch.nn", nn), ("torch.nn.Parameter", nn.Parameter), ("math", math), ("builtins", builtins))
    seen = set()
    for cls in vars(nn).values():   # nn.Module and every layer: their forward, __call__, hooks
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            for klass in cls.__mro__:
                if klass not in seen and klass.__module__.startswith("torch."):
                    seen.add(klass)
                    yield f"torch.nn.{klass.__name__}", klass


_STATEMENTS = ("__import__", "__build_class__")


def _pinnable(value: Any) -> bool:
    return callable(value) or isinstance(value, (staticmethod, classmethod, property))


def _snapshot() -> dict[tuple[int, str], tuple[str, Any, Any]]:
    """{(id of the namespace, attribute): (what the student would write, the namespace, the value)}."""
    found: dict[tuple[int, str], tuple[str, Any, Any]] = {}
    for shown, space in _namespaces():
        for name, value in list(vars(space).items()):
            # IPython keeps its last results in builtins._, __, ___: not Python's functions (but the import
            # statement's and the class statement's are: a submission's __import__ answered the course's own lazy
            # imports); torch.Storage follows the default dtype (torch.set_default_dtype rebinds it)
            skipped = space is builtins and name.startswith("_") and name not in _STATEMENTS \
                or space is torch and name == "Storage"
            if _pinnable(value) and not skipped:
                found[(id(space), name)] = (f"{shown}.{name}", space, value)
    return found


def _by_space(pinned: dict[tuple[int, str], tuple[str, Any, Any]]) -> list[tuple[Any, tuple[str, ...], tuple, Any]]:
    """Per namespace: (it, its pinned names, their values, a getter of them all at once), for one pass in C."""
    spaces = {id(space): space for _, space, _ in pinned.values()}
    found = []
    for key, space in spaces.items():
        names = tuple(name for (at, name) in pinned if at == key)
        getter = operator.itemgetter(*names) if len(names) > 1 else (lambda d, n=names[0]: (d[n],))
        found.append((space, names, tuple(pinned[(key, n)][2] for n in names), getter))
    return found


PINNED = _snapshot()
_BY_SPACE = _by_space(PINNED)
# A class's own names when pinned: a name set later on a class shadows its base's (``torch.Tensor.softmax = ...``
# hides TensorBase's softmax without changing it)
_CLASS_NAMES = {id(space): (shown, space, frozenset(vars(space))) for shown, space in _namespaces()
                if isinstance(space, type)}
_MISSING = object()
_TORCH_FILES = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep
_COURSE_FILES = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "..")) + os.sep


def _code_of(value: Any) -> Any:
    value = getattr(value, "__func__", value)
    value = value.fget if isinstance(value, property) else value
    return getattr(value, "__code__", None)


def replaced(written: bool = False) -> list[str]:
    """What the student's code has replaced: the names (``torch.equal``) whose value is no longer the pinned
    one; with ``written``, also those whose pinned value is a function written in the student's code (a
    replacement made before ``checks`` was imported: looked for once per check, it costs more)."""
    found = []
    for space, names, values, getter in _BY_SPACE:
        try:
            same = all(map(operator.is_, getter(vars(space)), values))   # one pass in C: the usual case
        except KeyError:   # a name deleted
            same = False
        if same and not written:
            continue
        for name, value in zip(names, values):
            shown = PINNED[(id(space), name)][0]
            now = vars(space).get(name, _MISSING)
            if now is not value and _own_rebinding(space, now, value):
                accept(space, name)
            elif now is not value:
                found.append(shown)
            elif written and (code := _code_of(now)) is not None and is_student_file(code.co_filename):
                found.append(shown)
    for shown, space, names in _CLASS_NAMES.values():
        own = vars(space)
        if len(own) == len(names) and all(map(own.__contains__, names)):
            continue   # (the usual case, in C)
        for name in own.keys() - names:
            if _shadows(space, name, own[name]):
                found.append(f"{shown}.{name}")
    return found


def _shadows(space: type, name: str, value: Any) -> bool:
    """Whether a name set on a pinned class since it was pinned changes what the checks get: a function of the
    student's code, or any other callable or descriptor where it is a special method (Python looks those up on the
    class: ``__getattribute__`` answers every attribute read) or a name a base has (``object``'s too). torch and
    the libraries add functions of their own as they load their parts (transformers: ``nn.Module.smart_apply``)."""
    code = _code_of(value)
    if code is not None:
        return is_student_file(code.co_filename)
    if not (callable(value) or inspect.getattr_static(type(value), "__get__", None) is not None):
        return False   # data, which no lookup calls (copyreg caches a class's __slotnames__ on it)
    return (name.startswith("__") and name.endswith("__")) or any(name in vars(base) for base in space.__mro__[1:])


def _own_rebinding(space: Any, new: Any, pinned: Any) -> bool:
    """Whether ``new`` was put there by torch's own code, wrapping what was pinned (importing torch._dynamo wraps
    torch.manual_seed; torch.compile wraps nn.Module.__init__ and __setstate__) or, in builtins, by the Jupyter
    kernel's (ipykernel binds input() anew for every cell): not a replacement by the student's code. Another of
    torch's functions put in a pinned one's place (``torch.equal = <a function of torch's that returns a tuple>``)
    is a replacement like any other."""
    code = _code_of(new)
    path = os.path.realpath(code.co_filename) if code is not None else ""
    kernels = space is builtins and any(part in path.replace("\\", "/") for part in ("/ipykernel/", "/IPython/"))
    return (path.startswith(_TORCH_FILES) and _same_function(new, pinned)) or kernels


def _same_function(new: Any, pinned: Any) -> bool:
    """Whether ``new`` is ``pinned``, a wrapper of it, or what it wraps (a check leaves torch as it found it: the
    pinned wrapper's original back in its place)."""
    return _wraps(new, pinned) or _wraps(pinned, new)


def _wraps(new: Any, pinned: Any) -> bool:
    """Whether ``new`` is ``pinned`` or wraps it: its ``__wrapped__`` (functools.wraps) or a cell of its closure
    (torch.compile's patched ``nn.Module.__init__``) holds it, or holds what does."""
    for _ in range(8):
        if new is pinned:
            return True
        if not isinstance(new, FunctionType):
            return False
        if any(cell.cell_contents is pinned for cell in new.__closure__ or () if cell.cell_contents is not None):
            return True
        new = vars(new).get("__wrapped__")
    return False


def expect_unpatched(written: bool = False) -> None:
    """Fail with ``patched`` when anything pinned is replaced (see the module's docstring and ``replaced``)."""
    names = replaced(written)
    if names:
        fail("patched", patched_message(names))


def patched_message(names: list[str]) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"{shown} {'has' if len(names) == 1 else 'have'} been replaced by code in this notebook (an "
            f"assignment such as `torch.equal = ...`, a setattr, perhaps in a default argument). Checks compare "
            f"with torch's own functions, and every later cell would see the replacement too. Remove that code, "
            f"restart the kernel (Kernel > Restart) and run the cells again.")


def accept(space: Any, name: str) -> None:
    """Pin ``space.name``'s present value (the check's own child replaces ``torch.set_num_threads``). Never for
    the student's code (a replacement of theirs pinned would never be ``patched``)."""
    if _called_by_student():
        return
    key = (id(space), name)
    if key in PINNED:
        shown, _, _ = PINNED[key]
        PINNED[key] = (shown, space, getattr(space, name))
        for i, (pinned_space, names, values, getter) in enumerate(_BY_SPACE):
            if pinned_space is space:
                values = tuple(PINNED[(id(space), n)][2] for n in names)
                _BY_SPACE[i] = (pinned_space, names, values, getter)


def tables() -> tuple[Any, ...]:
    """Copies of the pin tables as they are now: the grader compares the tables with them once the student's code has
    run (a submission that empties them, or pins its own function in one, makes its replacement pass unseen)."""
    return dict(PINNED), tuple(_BY_SPACE), dict(_CLASS_NAMES)


def tables_intact(then: tuple[Any, ...]) -> bool:
    """Whether the pin tables still hold what ``tables()`` gave, but for torch's own wrappers of a pinned function."""
    pinned, by_space, class_names = then
    if len(PINNED) < len(pinned) or len(_BY_SPACE) != len(by_space) or len(_CLASS_NAMES) != len(class_names):
        return False
    for key, (_, space, value) in pinned.items():
        now = PINNED.get(key)
        if now is None or now[1] is not space or not _same_function(now[2], value):
            return False
    for (space, names, values, getter), (now_space, now_names, now_values, now_getter) in zip(by_space, _BY_SPACE):
        if now_space is not space or now_names != names or now_getter is not getter or len(now_values) != len(values) \
                or not all(map(_same_function, now_values, values)):
            return False
    return all(_CLASS_NAMES.get(key) is value for key, value in class_names.items())


def _called_by_student() -> bool:
    """Whether the code that called ``accept`` is the student's: directly, or through other libraries' functions
    only (a finalizer's ``__call__``); the course's own callers are not."""
    frame = sys._getframe(2)   # 0: this, 1: accept, 2: its caller
    while frame is not None:
        filename = frame.f_code.co_filename
        if is_student_file(filename):
            return True
        if os.path.realpath(filename).startswith(_COURSE_FILES):
            return False
        frame = frame.f_back
    return False


def save() -> Callable[[], None]:
    """Remember the pinned names' present values (a kernel's, patched or not); the function returned puts back
    any that a check's code changed, so a check leaves the kernel as it found it."""
    present = {key: vars(space).get(key[1], _MISSING) for key, (_, space, _) in PINNED.items()}
    added = {key: vars(space).keys() - names for key, (_, space, names) in _CLASS_NAMES.items()}

    def restore() -> None:
        for key, value in present.items():
            _, space, _ = PINNED[key]
            name = key[1]
            if vars(space).get(name, _MISSING) is not value:
                try:
                    if value is _MISSING:
                        delattr(space, name)
                    else:
                        setattr(space, name, value)
                except (AttributeError, TypeError):   # a builtin type's slot cannot be set back
                    pass
        for key, (_, space, names) in _CLASS_NAMES.items():
            for name in vars(space).keys() - names - added[key]:   # a name the check's code set on a class
                try:
                    delattr(space, name)
                except (AttributeError, TypeError):
                    pass
    return restore


# ---------------------------------------------------------------- torch's modes
# A TorchFunctionMode (or TorchDispatchMode) on torch's stack answers every torch call made while it is there,
# the checker's own `torch.equal` included. The check sets aside the modes it finds (a `with torch.device(...)`
# too), and puts them back as they were when it ends; a mode that the student's code leaves on the stack during
# the check is taken off and is the verdict `patched`.

def set_aside_modes() -> tuple[list[Any], list[Any]]:
    """Take every mode off torch's two stacks: (function modes, dispatch modes), innermost first."""
    functions = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    dispatches = [torch._C._pop_torch_dispatch_stack() for _ in range(torch._C._len_torch_dispatch_stack())]
    return functions, dispatches


def restore_modes(saved: tuple[list[Any], list[Any]]) -> None:
    """Put back what ``set_aside_modes`` took, outermost first, over whatever the check left."""
    functions, dispatches = saved
    for mode in reversed(functions):
        torch._C._push_on_torch_function_stack(mode)
    for mode in reversed(dispatches):
        torch._C._push_on_torch_dispatch_stack(mode)


def modes_depth() -> tuple[int, int]:
    return torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()


def expect_no_new_modes(before: tuple[int, int]) -> None:
    """After a call of the student's code: modes it pushed and left are taken off, and the verdict is ``patched``."""
    functions, dispatches = before
    left = [type(torch._C._pop_torch_function_stack()).__name__
            for _ in range(torch._C._len_torch_function_stack() - functions)]
    left += [type(torch._C._pop_torch_dispatch_stack()).__name__
             for _ in range(torch._C._len_torch_dispatch_stack() - dispatches)]
    if left:
        fail("patched", f"Your code left a torch mode active ({', '.join(left)}): it would answer every torch call "
                        f"after it, the check's own comparisons too. Enter a mode only in a `with` block that ends "
                        f"inside your function.")
