"""The probing loop of an exercise whose answer is a function of tensors, written once (``judge``), and the
one mistake loop (``first_mistake``), which judges of their own use too. The order is ``FunctionExercise``'s.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import itertools
import math
import numbers
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FunctionType, MethodType
from typing import Any

import torch

from ...exercises import Mistake
from ...verdict import Failure, fail
from .._device_probe import meta
from .._device_probe import probe as probe_device
from .._model_common import as_tensor
from .._student_code import (
    HALF_PRECISION,
    call_student,
    close,
    close_in_float64,
    coarse_precision,
    expect_callable,
    expect_tensor,
    matches,
    max_diff,
)
from .probes import (
    DTYPE_ADVICE,
    batch_mixing,
    called_in_bfloat16,
    dtypes_met,
    expect_dtype_in_bfloat16,
    gradient_probe,
    in_bfloat16,
    in_float64,
    random_or_kept,
)
from .scale_fit import ScaleFit, fitted_scale


@dataclass(frozen=True)
class Case:
    """One input: the arguments as the student's function takes them, ``what`` names the call in messages,
    ``notes`` are shown beside a counter-example on this input (the reference's scores, say)."""

    args: tuple[Any, ...]
    what: str
    notes: tuple[tuple[str, torch.Tensor], ...] = ()

    def given(self) -> tuple[Any, ...]:
        """Fresh copies of the tensors: the student's code gets its own, the case stays as declared."""
        return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in self.args)


# What a message says when the output differs and no mistake in the exercise's table reproduces it
UNEXPLAINED = "none of the mistakes we test for explains it on its own (it may be another, or two at once)"


@dataclass(frozen=True)
class Run:
    case: Case
    out: Any
    expected: torch.Tensor


@dataclass(frozen=True)
class FunctionExercise:
    """An exercise answered by a function: the declaration ``judge`` runs. Each case -> call the student
    (``_student_code.call_student``: exceptions, ``sys.exit``, changed inputs are verdicts) -> expect a tensor
    like the reference's -> compare -> on a difference: ``mistakes``, ``diagnose``, ``mismatch``; once every
    case agrees: ``after``, the gradient probe, ``success``.

    - ``cases()`` the inputs, in order; ``reference`` the course's function; ``arg_names`` name the arguments.
    - ``mistakes``: the known mistakes, tried in order on the runs that differ (``Mistake.output(*args)``, or
      ``variant(*args, spec=...)`` for a spec); the first that matches every one of them is the verdict.
    - ``exact``: outputs are compared bit for bit (masks, rearrangements); otherwise within tolerance.
    - ``each_case``: judge a case as soon as it runs, and quote it in the mistake's message ("causal_mask(5):
      ..."; ``quote=False``: the message as written); otherwise all cases run first and a mistake must match
      all of them. A mistake's message may name ``{got}``, ``{expected}`` (see ``quoted``) and what
      ``values(run)`` gives, filled from the first run that differs.
    - ``dtype``: the output must have the reference's dtype; ``finite``: NaN is refused before any diagnosis;
      ``numpy_ok``: a numpy array counts as a tensor.
    - ``raw(case, out)``: judge the raw output before its shape is checked (a layout of its own).
    - ``reword(failure, case, out, fn)``: add to a failure of the call or of the shape (may raise another).
    - ``scales``: where a factor on the scores may sit (``scale_fit.ScaleFit``); once no mistake matched, a
      factor found for every run that differs from the right one is the verdict ``scale``, with its value.
    - ``diagnose(runs, fn)``: the exercise's own probes once no mistake matched (may return: then mismatch).
    - ``mismatch(run)``: the last word on the first run that differs.
    - ``after(runs, fn)``: the exercise's own probes once every case is right, before the gradients.
    - ``gradients()``: the cases of the gradient probe; ``examples()``: tiny cases for the counter-example.
    - ``magnitude()``: the cases of the magnitude probe (``probes.magnitude_rows``/``magnitude_scores`` make
      their inputs; ``what`` says which magnitude), judged once everything else holds: a difference is a
      known mistake, else ``overflow`` (NaN or inf) or ``magnitude``, with ``stability`` as the advice.
    - the dtype probe (``"dtype"`` in ``probes``, the default): every case again with float64 inputs and
      float64 as the default dtype; the output's dtype must follow the reference's, its values too.
    - the bfloat16 probe (``"bfloat16"``, for the exercises whose text asks for the inputs' dtype): every case
      with floating inputs again in bfloat16, where a tensor made in float32 is not promoted away; only the
      output's dtype is judged.
    - a wrong output that torch's random state changes while the reference's does not is ``dropout``.
    """

    id: str
    name: str
    reference: Callable[..., Any]
    cases: Callable[[], Sequence[Case]]
    arg_names: tuple[str, ...]
    success: str
    mismatch: Callable[[Run], str]
    mistakes: Sequence[Mistake] = ()
    variant: Callable[..., Any] | None = None
    exact: bool = False
    each_case: bool = False
    quote: bool = True
    dtype: bool = True
    finite: bool = False
    numpy_ok: bool = False
    item_axes: int = 2    # the batch probe: how many trailing axes make one item (2: a matrix; 1: a row)
    raw: Callable[[Case, Any], None] | None = None
    reword: Callable[[Failure, Case, Any, Any], None] | None = None
    scales: Sequence[ScaleFit] = ()
    diagnose: Callable[[list[Run], Any], None] | None = None
    after: Callable[[list[Run], Any], None] | None = None
    values: Callable[[Run], Mapping[str, Any]] = lambda run: {}
    gradients: Callable[[], Sequence[Case]] = lambda: ()
    examples: Callable[[], Sequence[Case]] | None = None
    magnitude: Callable[[], Sequence[Case]] = lambda: ()
    stability: str = ("A softmax must hold for any scores: subtract each row's own maximum before exp (a "
                      "running maximum that starts at -inf, never at 0, and never one shared by all rows), so "
                      "that the largest term is exp(0) = 1 and no row underflows to 0/0.")
    probes: tuple[str, ...] = field(default=("gradient", "mutation", "reference_guard", "counterexample", "dtype",
                                             "global_state"))

    def same(self, out: Any, expected: torch.Tensor) -> bool:
        if self.exact:
            return isinstance(out, torch.Tensor) and out.shape == expected.shape and bool(torch.equal(out, expected))
        return close(out, expected)

    def mistaken(self, mistake: Mistake, case: Case) -> Any:
        """The mistake's output on the case (None where it does not apply)."""
        if mistake.output is not None:
            return mistake.output(*case.args)
        assert self.variant is not None, f"exercise {self.id}: a mistake with a spec needs the exercise's variant"
        return self.variant(*case.args, spec=mistake.spec)


def keeps_number(fn: Any, value: float) -> bool:
    """Whether ``fn`` holds the number ``value`` where a call can leave it for the next: among its defaults, its
    attributes (and its class's, for a callable object), its closure or the globals its code names, directly or as
    an item of a dict, list, tuple or set there. A factor kept from an earlier call sits there; one written into the
    code (a constant, or a name bound once) and a log or a warn-once flag kept beside it do not make the number
    appear there."""
    places = [*(getattr(fn, "__defaults__", None) or ()), *(getattr(fn, "__kwdefaults__", None) or {}).values(),
              *(vars(fn).values() if hasattr(fn, "__dict__") else ())]
    if not isinstance(fn, FunctionType):   # a callable object: its class's attributes too, and its __call__'s
        places += [v for k, v in vars(type(fn)).items() if not k.startswith("__")]
        fn = vars(type(fn)).get("__call__", fn)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            places.append(cell.cell_contents)
        except ValueError:   # a cell not filled yet
            continue
    code, names = getattr(fn, "__code__", None), getattr(fn, "__globals__", None) or {}
    places += [names.get(name) for name in (code.co_names if code is not None else ()) if name in names]

    def same(item: Any) -> bool:
        if isinstance(item, torch.Tensor) and item.numel() == 1:
            item = float(item)
        return isinstance(item, (int, float)) and not isinstance(item, bool) and math.isclose(item, value,
                                                                                            rel_tol=1e-3)
    for place in places:
        items = list(place.values()) if isinstance(place, dict) else list(place) \
            if isinstance(place, (list, tuple, set)) else [place]
        if any(same(item) for item in items):
            return True
    return False


# Modules whose functions and classes are not the student's: their state is no place a student's call keeps one.
_NOT_STUDENTS = ("torch", "course_lib", "builtins", "typing", "abc", "functools", "numpy", "math", "collections")
_MISSING = object()   # a place empty when taken (a global or a class attribute made by a later call)


def _students(obj: Any) -> bool:
    return (getattr(obj, "__module__", None) or "builtins").split(".")[0] not in _NOT_STUDENTS


def _plain(value: Any, depth: int = 0) -> bool:
    """Data a call can leave for the next and a copy can stand for: numbers, strings, small tensors and containers
    of them (a function, a module, a class, a large object is kept as it is)."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() <= 1 << 16 and not isinstance(value, torch.nn.Parameter)
    if isinstance(value, (list, tuple, set, frozenset, dict)) and depth < 4 and len(value) <= 1000:
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        return all(_plain(item, depth + 1) for item in items)
    return False


def _copy(value: Any) -> Any:
    """A copy of what a place holds, item by item for the tuple of a function's defaults or a dict of attributes:
    plain data copied, anything else kept as it is."""
    if _plain(value):
        try:
            return copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - a tensor autograd will not copy: kept as it is
            return value
    if type(value) is tuple:
        return tuple(_copy(item) for item in value)
    if type(value) is dict:
        return {key: _copy(item) for key, item in value.items()}
    return value


def _code_names(code: Any) -> set[str]:
    """The global names a code object and the functions, lambdas and comprehensions inside it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


class Afresh:
    """The places where the student's code can keep something from one call to the next, as they were when taken
    (before the check's first call): a function's defaults, attributes and closure, the globals its code reads,
    the attributes of the student's classes (and so on for the student's functions and classes these name).
    ``with start.restored():`` runs code as a first call in a fresh kernel would, then puts back what is there."""

    def __init__(self, root: Any) -> None:
        self.places: list[tuple[str, Any, Any]] = []   # (kind, owner, key)
        self._visit(root, set())
        self.saved = [_copy(self._get(place)) for place in self.places]

    def _visit(self, obj: Any, seen: set[int]) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, (staticmethod, classmethod, MethodType)):
            obj = obj.__func__
        if isinstance(obj, FunctionType) and not _students(obj):   # the course's wrapper: what it closes over
            for cell in obj.__closure__ or ():
                contents = self._get(("cell", cell, None))
                if callable(contents) and _students(contents if isinstance(contents, (FunctionType, type))
                                                    else type(contents)):
                    self._visit(contents, seen)
            return
        if isinstance(obj, FunctionType):
            self.places += [("attr", obj, "__defaults__"), ("attr", obj, "__kwdefaults__"),
                            ("dict", obj.__dict__, None)]
            self.places += [("cell", cell, None) for cell in obj.__closure__ or ()]
            for name in sorted(_code_names(obj.__code__)):
                self.places.append(("global", obj.__globals__, name))
                found = obj.__globals__.get(name)
                if isinstance(found, (FunctionType, type)) and _students(found):
                    self._visit(found, seen)
            return
        if not isinstance(obj, type):   # a callable object: its class, and what it holds if it is no module
            if hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module) and _students(type(obj)):
                self.places.append(("dict", vars(obj), None))
            obj = type(obj)
        for cls in obj.__mro__:
            if _students(cls):
                self.places.append(("class", cls, None))
                for item in list(vars(cls).values()):
                    if isinstance(item, (FunctionType, staticmethod, classmethod)):
                        self._visit(item, seen)

    @staticmethod
    def _get(place: tuple[str, Any, Any]) -> Any:
        kind, owner, key = place
        if kind == "attr":
            return getattr(owner, key)
        if kind == "cell":
            try:
                return owner.cell_contents
            except ValueError:
                return _MISSING
        if kind == "global":
            return owner.get(key, _MISSING)
        items = vars(owner) if kind == "class" else owner
        return {name: value for name, value in items.items() if kind != "class" or not name.startswith("__")}

    @staticmethod
    def _set(place: tuple[str, Any, Any], value: Any) -> None:
        kind, owner, key = place
        if kind == "attr":
            setattr(owner, key, value)
        elif kind == "cell":
            if value is _MISSING:
                del owner.cell_contents
            else:
                owner.cell_contents = value
        elif kind == "global":
            if value is _MISSING:
                owner.pop(key, None)
            else:
                owner[key] = value
        else:
            now = Afresh._get(place)
            for name in now.keys() - value.keys():
                delattr(owner, name) if kind == "class" else owner.pop(name)
            for name, item in value.items():
                if now.get(name, _MISSING) is not item:
                    setattr(owner, name, item) if kind == "class" else owner.__setitem__(name, item)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        now = [self._get(place) for place in self.places]
        try:
            for place, value in zip(self.places, self.saved):
                self._set(place, _copy(value))
            yield
        finally:
            for place, value in zip(self.places, now):
                self._set(place, value)


def kept_from_start(what: str, how: str) -> str:
    """The ``kept_state`` message of a call that is wrong in turn and right when the student's code starts afresh
    (``Afresh``): ``how`` says what was wrong."""
    return (f"{what} {how}, yet the same call is right when your code starts afresh (its default arguments, "
            f"globals and class attributes as they were before the checker's first call): your code keeps a value "
            f"from an earlier call (a scale, a size, a count or a whole result, worked out on an earlier call and "
            f"stored in a default argument, a global or on the class, or cached under a key that leaves out some of "
            f"the inputs) and reuses it on inputs it does not fit. Compute it from each call's own inputs.")


# The state of the student's code when the running ``judge`` began (``Afresh``)
_START: contextvars.ContextVar[Afresh | None] = contextvars.ContextVar("start", default=None)


def _kept_since_start(exercise: FunctionExercise, case: Case, out: Any, fn: Any) -> None:
    """``kept_state`` where the case, wrong (or failing) in the course of the check, is right when called with the
    student's code as it was before the check's first call: what it got wrong it took from an earlier call."""
    start = _START.get()
    if start is None or not start.places:
        return
    expected = exercise.reference(*case.args)
    with start.restored():
        try:   # held to all that the case is held to in ``judge``: its layout, shape, dtype, finite numbers
            fresh = call_student(fn, *case.given(), what=case.what)
            fresh = as_tensor(fresh) if exercise.numpy_ok else fresh
            if exercise.raw is not None:
                exercise.raw(case, fresh)
            expect_tensor(fresh, tuple(expected.shape), case.what, dtype=expected.dtype if exercise.dtype else None,
                          finite=exercise.finite)
        except Failure:
            return
    if exercise.same(fresh, expected):
        _stale(exercise, [Run(case, out, expected)], [], fn)   # a running value carried from call to call: its words
        same_shape = isinstance(out, torch.Tensor) and out.shape == expected.shape
        how = (f"differs from the reference by up to {max_diff(out, expected):.3g}" if same_shape
               and out.is_floating_point() else f"differs from the reference in {int((out != expected).sum())} of "
               f"its {out.numel()} entries" if same_shape else "is wrong")
        fail("kept_state", kept_from_start(case.what, how))


def judge(exercise: FunctionExercise, fn: Any) -> str:
    """Run ``exercise`` on the student's ``fn``: the success message, or a Failure naming what is wrong."""
    token = _START.set(Afresh(fn))
    try:
        return _judge(exercise, fn)
    finally:
        _START.reset(token)


def _judge(exercise: FunctionExercise, fn: Any) -> str:
    expect_callable(fn, exercise.name)
    runs: list[Run] = []
    for case in exercise.cases():
        expected = exercise.reference(*case.args)
        out = None
        try:
            out = call_student(fn, *case.given(), what=case.what)
            if exercise.numpy_ok:
                out = as_tensor(out)
            if exercise.raw is not None:
                exercise.raw(case, out)
            expect_tensor(out, tuple(expected.shape), case.what, dtype=expected.dtype if exercise.dtype else None,
                          finite=exercise.finite)
        except Failure as failure:
            if any(not exercise.same(run.out, run.expected) for run in runs):
                _diagnose(exercise, runs, fn)   # wrong outputs before the call that failed say more than it does
            _kept_since_start(exercise, case, out, fn)
            _dtypes_meet(case, failure)
            if exercise.reword is not None:
                exercise.reword(failure, case, out, fn)
            raise
        runs.append(Run(case, out, expected))
        if exercise.each_case and not exercise.same(out, expected):
            _diagnose(exercise, [runs[-1]], fn, earlier=runs[:-1])
    if any(not exercise.same(run.out, run.expected) for run in runs):
        _diagnose(exercise, runs, fn)
    _other_numbers(exercise, fn, runs)
    if exercise.after is not None:
        exercise.after(runs, fn)
    for case in exercise.gradients():
        gradient_probe(fn, exercise.reference, case.args, exercise.arg_names, case.what)
    for case in exercise.magnitude():
        _at_magnitude(exercise, case, fn, runs)
    if "device" in exercise.probes:
        _on_meta(exercise, fn)
    if "dtype" in exercise.probes:
        _in_float64(exercise, fn)
    if "bfloat16" in exercise.probes:
        _in_bfloat16(exercise, fn)
    return exercise.success


def _in_bfloat16(exercise: FunctionExercise, fn: Any) -> None:
    """The bfloat16 probe, after the float64 one: every case with floating inputs again in bfloat16, where a tensor
    the code makes in float32 (torch.zeros(shape) without dtype=) is not promoted away as float64 promotes it. Only
    the output's shape and dtype are judged (``probes.expect_dtype_in_bfloat16``; its values were judged in float32
    and float64); an error of two dtypes meeting is ``dtype``, any other (no bfloat16 kernel, numpy) inconclusive."""
    for case in exercise.cases():
        if not any(isinstance(a, torch.Tensor) and a.is_floating_point() for a in case.args):
            continue
        shape = tuple(exercise.reference(*case.args).shape)
        given = Case(in_bfloat16(case.args), f"{case.what} in bfloat16")
        out = called_in_bfloat16(lambda given=given: call_student(fn, *given.given(), what=given.what), given.what)
        if out is None:
            return
        expect_dtype_in_bfloat16(expect_tensor(out, shape, given.what, finite=False), given.what)


def _dtypes_meet(case: Case, failure: Failure) -> None:
    """``dtype`` where a case whose floating inputs are not all in the default dtype (float16, float64) raised an
    error of two dtypes meeting: a tensor of the code made in the default dtype meets them."""
    floats = sorted({str(a.dtype).removeprefix("torch.") for a in case.args
                     if isinstance(a, torch.Tensor) and a.is_floating_point()})
    said = dtypes_met(failure, case.what) if failure.diagnosis == "exception" else None
    if said is None or not floats or floats == [str(torch.get_default_dtype()).removeprefix("torch.")]:
        return
    raise Failure("dtype", f"{case.what}: your code raised {said}: two dtypes meet in it, the inputs' "
                           f"{' and '.join(floats)} and another (a tensor made without dtype=, in the default "
                           f"float32, or an input not cast to the dtype of the result). {DTYPE_ADVICE}",
                  **failure.details) from None


def _on_meta(exercise: FunctionExercise, fn: Any) -> None:
    """The device probe: every case again with its tensors on the meta device (free to run), where a tensor the
    code made on the CPU, or a result moved there, shows; every case, since a branch (an offset, a cache) may
    make one only on some. Cases without a tensor have no device to follow."""
    for case in exercise.cases():
        if any(isinstance(a, torch.Tensor) for a in case.args):
            args = [meta(a) if isinstance(a, torch.Tensor) else a for a in case.args]
            probe_device(lambda args=args: fn(*args), case.what)


def _at_magnitude(exercise: FunctionExercise, case: Case, fn: Any, runs: list[Run]) -> None:
    """One case of the magnitude probe: right, a known mistake, or ``overflow``/``magnitude``. The student's code
    was right on every ordinary case (``runs``), so only a mistake that is right there too can be theirs."""
    expected = exercise.reference(*case.args)
    out = call_student(fn, *case.given(), what=case.what)
    out = as_tensor(out) if exercise.numpy_ok else out
    expect_tensor(out, tuple(expected.shape), case.what, dtype=expected.dtype if exercise.dtype else None,
                  finite=False)
    if exercise.same(out, expected):
        return
    run = Run(case, out, expected)
    _kept_since_start(exercise, case, out, fn)

    def reproduces(mistake: Mistake) -> bool:
        # Strictly: here NaN and inf are what a mistake produces, so a mistake's NaN (which elsewhere may stand for
        # "undefined") must fall exactly where the student's does, and the finite rest agree.
        if not all(_right_on(exercise, mistake, ordinary) for ordinary in runs):
            return False
        wrong = exercise.mistaken(mistake, case)
        if not isinstance(wrong, torch.Tensor) or wrong.shape != out.shape:
            return False
        if not (wrong.is_floating_point() and out.is_floating_point()):
            return exercise.same(out, wrong)
        finite = wrong.isfinite()
        return (bool(torch.equal(finite, out.isfinite())) and bool(torch.equal(wrong.isnan(), out.isnan()))
                and close(out[finite], wrong[finite]))
    first_mistake(exercise.mistakes, reproduces,
                  f"{case.what}: " if exercise.each_case and exercise.quote else "",
                  got=quoted(out), expected=quoted(expected), **exercise.values(run))
    if out.is_floating_point() and not bool(torch.isfinite(out).all()):
        fail("overflow", f"{case.what}: your result holds NaN or inf where the reference's is finite, although "
                         f"it is right on well-scaled inputs. {exercise.stability}")
    fail("magnitude", f"{case.what}: your result differs from the reference's by up to "
                      f"{max_diff(out, expected):.3g}, although it is right on well-scaled inputs. "
                      f"{exercise.stability}")


def _right_on(exercise: FunctionExercise, mistake: Mistake, run: Run) -> bool:
    """Whether ``mistake`` gives the reference's output on the run's case (it does not apply: then it may)."""
    try:
        wrong = exercise.mistaken(mistake, run.case)
    except (RuntimeError, ValueError, IndexError):
        return True
    return wrong is None or exercise.same(wrong, run.expected)


def _in_float64(exercise: FunctionExercise, fn: Any) -> None:
    """The dtype probe: the cases again with float64 inputs, first in the notebook's own default dtype (a new
    tensor made without dtype=, torch.zeros(...), comes out float32 there), then in a notebook whose default is
    float64 (a dtype written into the code, .float(), still comes out float32)."""
    previous = torch.get_default_dtype()
    passes = [(torch.float64, True)]   # (the default dtype, whether that is a float64 notebook)
    if previous != torch.float64:
        passes.insert(0, (previous, False))
    for default, float64_notebook in passes:
        torch.set_default_dtype(default)
        try:
            for case in exercise.cases():
                floating = any(isinstance(a, torch.Tensor) and a.is_floating_point() for a in case.args)
                if not float64_notebook and (not floating or any(isinstance(a, torch.nn.Module) for a in case.args)):
                    continue   # nothing float64 to give (4.1's ints); a layer built in the default dtype (12.2)
                said = (f"in a float64 notebook (torch.set_default_dtype(torch.float64)"
                        f"{', float64 inputs' if floating else ''})" if float64_notebook else "with float64 inputs")
                _judged_in_float64(exercise, fn, Case(in_float64(case.args), f"{case.what} {said}"))
        finally:
            torch.set_default_dtype(previous)


def _judged_in_float64(exercise: FunctionExercise, fn: Any, case: Case) -> None:
    expected = exercise.reference(*case.args)
    # nothing to take a dtype from (4.1's two ints): the text asks for no dtype, so float32 is as right as
    # the default, and code that mixes the two (a float32 arange times a default-dtype tensor) is right in
    # the notebook it was written for: only its values are judged here, at float32's tolerance
    dtype_free = not any(isinstance(a, torch.Tensor) and a.is_floating_point() for a in case.args)
    try:
        out = call_student(fn, *case.given(), what=case.what)
    except Failure as failure:
        if dtype_free and failure.diagnosis == "exception":
            return
        said = dtypes_met(failure, case.what) if failure.diagnosis == "exception" else None
        if said is not None:   # it ran on float32 inputs: a float32 tensor of the code meets the float64 ones
            raise Failure("dtype", f"{case.what}: your code raised {said}, though it runs on float32 inputs: a "
                                   f"float32 tensor of your code (or a dtype written in, softmax(..., "
                                   f"dtype=torch.float32)) meets the float64 inputs. {DTYPE_ADVICE}",
                          **failure.details) from None
        raise
    out = as_tensor(out) if exercise.numpy_ok else out
    lower = (isinstance(out, torch.Tensor) and out.is_floating_point() and expected.is_floating_point()
             and torch.finfo(out.dtype).eps > torch.finfo(expected.dtype).eps)   # float32 for float64
    coarse = lower and torch.finfo(out.dtype).eps > torch.finfo(torch.float32).eps   # float16, bfloat16
    if dtype_free:
        lower = False
        out = out.to(expected.dtype) if isinstance(out, torch.Tensor) and out.is_floating_point() else out
    if isinstance(out, torch.Tensor) and (exercise.dtype and out.dtype != expected.dtype or lower):
        fail("dtype", f"{case.what}: your result is {out.dtype}, expected {expected.dtype}. A dtype is "
                      f"written into your code (torch.float32, .float(), a fixed dtype=..., or a new tensor made "
                      f"without one, which takes the default): make new tensors like the inputs "
                      f"(torch.zeros_like(x), x.new_zeros(...), dtype=x.dtype).")
    expect_tensor(out, tuple(expected.shape), case.what, finite=False)
    if not (exercise.same(out, expected) if exercise.exact or dtype_free else close_in_float64(out, expected)):
        if dtype_free:
            how = "your result is a half-precision tensor" if coarse else "float16 or bfloat16 on the way"
            fail("precision", f"{case.what}: your result differs from the reference's by up to "
                              f"{max_diff(out, expected):.3g}, more than float32's rounding explains: part of "
                              f"your computation runs in a lower precision ({how}). Compute in float32 or the "
                              f"default dtype.")
        if not (close(out, expected) or coarse_precision(out, expected)):   # no rounding: another result
            _diagnose(exercise, [Run(case, out, expected)], fn, kept="on the same cases in float64")
        fail("precision", f"{case.what}: your result differs from the reference's by up to "
                          f"{max_diff(out, expected):.3g}, which float64 does not explain: part of your "
                          f"computation runs in a lower precision (.half(), torch.bfloat16, an autocast, a "
                          f"float16 tensor). Keep the inputs' dtype throughout.")


def _diagnose(exercise: FunctionExercise, runs: list[Run], fn: Any, earlier: list[Run] | None = None,
              kept: str = "") -> None:
    """The first mistake that reproduces every run, else a factor on the scores that explains them and the
    ``earlier`` runs (right ones: a factor right there and wrong here is written into the code), else the
    exercise's own probes, else its mismatch. ``kept``: how a case was called again once every case was right
    (``kept_part``): what no known mistake explains there, nor a rounding, is a result kept in part."""
    first = next(run for run in runs if not exercise.same(run.out, run.expected))
    _kept_since_start(exercise, first.case, first.out, fn)   # before any mistake its symptom looks like
    _drawn_at_random(exercise, first, fn)
    # a mistake explains these runs, and changes none of the earlier ones the student's code got right
    explains = lambda mistake: all(_reproduces(exercise, mistake, run) for run in runs) and \
        all(_explains(exercise, mistake, run) is not False for run in earlier or [])
    first_mistake(exercise.mistakes, explains, f"{first.case.what}: " if exercise.each_case and exercise.quote else "",
                  got=quoted(first.out), expected=quoted(first.expected), **exercise.values(first))
    for fit in exercise.scales:
        found = fitted_scale(fit, [(run.case.args, run.case.what, run.out) for run in (earlier or []) + runs
                                   if isinstance(run.out, torch.Tensor)], held=lambda factor: keeps_number(fn, factor))
        if found is not None:
            fail("scale", found)
    if "batch" in exercise.probes and not kept:
        _batch_items(exercise, first, fn)
    if exercise.diagnose is not None and not kept:
        exercise.diagnose(runs, fn)
    _stale(exercise, runs, earlier or [], fn)   # no verdict of the exercise's own: a result of an earlier call?
    # no verdict of the exercise's own: an output off by a rounding's size everywhere is a lower precision
    rounded = lambda run: coarse_precision(run.out, run.expected) or exercise.exact and close(run.out, run.expected)
    if all(rounded(run) for run in runs if not exercise.same(run.out, run.expected)):
        fail("precision", f"{first.case.what}: {HALF_PRECISION} (Off by up to {max_diff(first.out, first.expected):.3g}.)")
    if kept:
        fail("kept_state", kept_part(first.case.what, kept, first.out, first.expected))
    factors = [_factor(run.out, run.expected) for run in runs if not exercise.same(run.out, run.expected)
               and _numbers(run.expected) >= _FEW]   # one number (a loss) is a multiple of any other: it says nothing
    if factors and None not in factors:
        fail("scale", f"{first.case.what}: your result is exactly {_said(factors[0])} the reference's"
                      f"{' (in every case, by a factor of its own)' if len(set(factors)) > 1 else ''}: a sum where a "
                      f"mean is meant, a mean over the wrong count, or a factor written into your code.")
    _one_of_two(exercise, runs)
    fail("mismatch", exercise.mismatch(first))


def _drawn_at_random(exercise: FunctionExercise, run: Run, fn: Any) -> None:
    """``dropout`` where the wrong output changes with torch's random state (the same seed, the same output: not a
    state kept from call to call) while the reference's does not: something random runs in the student's code."""
    same = lambda a, b: isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
        and bool(torch.equal(a, b) or exercise.same(a, b))
    try:
        drawn = random_or_kept(lambda: as_tensor(call_student(fn, *run.case.given(), what=run.case.what))
                               if exercise.numpy_ok else call_student(fn, *run.case.given(), what=run.case.what), same)
    except Failure:
        return
    if drawn == "random" and random_or_kept(lambda: exercise.reference(*run.case.args), same) is None:
        fail("dropout", f"{run.case.what}: your output changes from call to call on the same inputs, with torch's "
                        f"random state: something random runs in your code (F.dropout, whose training= defaults to "
                        f"True, torch.rand, a random mask). {exercise.name} has nothing random: remove it (dropout "
                        f"belongs to a module, as nn.Dropout, which model.eval() switches off).")


def _batch_items(exercise: FunctionExercise, run: Run, fn: Any) -> None:
    """The ``batch`` probe on a run that differs: each item of the leading axes that its tensors and output share
    (batch, heads: all but the last ``item_axes``) run on its own. Each right alone, wrong together:
    ``batch_mixing``."""
    out, tensors = run.out, [arg for arg in run.case.args if isinstance(arg, torch.Tensor)]
    if not isinstance(out, torch.Tensor) or not tensors:
        return
    lead, inner = 0, exercise.item_axes
    while lead < out.dim() - inner and all(t.dim() - inner > lead and t.shape[lead] == out.shape[lead]
                                           for t in tensors):
        lead += 1
    items = list(itertools.product(*(range(size) for size in out.shape[:lead])))
    alone = []
    for item in items if len(items) > 1 else ():
        args = tuple(arg[tuple(slice(i, i + 1) for i in item)] if isinstance(arg, torch.Tensor) else arg
                     for arg in run.case.args)
        got = call_student(fn, *Case(args, run.case.what).given(), what=run.case.what)
        if not isinstance(got, torch.Tensor) or not exercise.same(got, exercise.reference(*args)):
            return
        alone.append(got.reshape(1, *out.shape[lead:]))
    if alone:
        batch_mixing(run.case.what, out.reshape(-1, *out.shape[lead:]), alone,
                     "your code sums or keeps a state over several of them at once. Compute each on its own: reduce "
                     "over its own axes only, and keep one state per item.",
                     item=lambda i: f"the item [{', '.join(map(str, items[i]))}] of the leading axes "
                                    f"{tuple(out.shape[:lead])}")


_KEPT = ("keeps its result from an earlier call (a cache keyed on the shapes, or on the tensor's id) instead of "
         "computing it from its inputs each time.")


def _stale(exercise: FunctionExercise, runs: list[Run], earlier: list[Run], fn: Any) -> None:
    """``kept_state`` when a wrong output is exactly the student's right output of an earlier case with other
    numbers of the same shapes (a result kept from that call), or when the first wrong case, called again, gives
    another result (a state carried from call to call)."""
    wrong = next((run for run in runs if isinstance(run.out, torch.Tensor) and not exercise.same(run.out, run.expected)),
                 None)
    if wrong is not None:
        try:
            again = call_student(fn, *wrong.case.given(), what=wrong.case.what)
        except Failure:
            again = None
        again = as_tensor(again) if exercise.numpy_ok else again
        # NaN where a query sees no key is the same answer twice, not a state carried over (NaN != NaN)
        if isinstance(again, torch.Tensor) and again.shape == wrong.out.shape and not exercise.same(again, wrong.out) \
                and not close(again, wrong.out, nan_ok=True):
            fail("kept_state", f"{wrong.case.what}, called twice, returned two different results: your function "
                               f"carries something from one call to the next (a running value stored on the "
                               f"function or in a global) instead of starting afresh from its inputs each time.")
    every = earlier + runs
    for place, run in enumerate(every):
        if place < len(earlier) or exercise.same(run.out, run.expected):
            continue
        for before in every[:place]:
            if isinstance(before.out, torch.Tensor) and isinstance(run.out, torch.Tensor) \
                    and before.out.shape == run.out.shape and exercise.same(before.out, before.expected) \
                    and exercise.same(run.out, before.out) and not exercise.same(run.expected, before.expected):
                fail("kept_state", f"{run.case.what} returned exactly what your function returned for an earlier "
                                   f"call with other inputs ({before.case.what}): it {_KEPT}")


def _flipped(arg: Any, back: int) -> Any:
    """A tensor's numbers in another order, its shape kept: flipped along its ``back``-th axis from the last, where
    that axis has more than one entry (floats, and integers: token ids, targets with their -100 padding, stay
    valid); a mask, a number, anything else as it is."""
    if not isinstance(arg, torch.Tensor) or arg.dtype == torch.bool or arg.dim() <= back or arg.shape[-1 - back] < 2:
        return arg
    return arg.flip(-1 - back)


def _numbers_in(case: Case) -> int:
    return sum(arg.numel() for arg in case.args if isinstance(arg, torch.Tensor))


def _other_inputs(runs: list[Run]) -> Iterable[tuple[Run, tuple[Any, ...], str]]:
    """The candidates of the "other numbers" re-run, with the run they vary and how: the case with the most numbers (its
    padding, its mask), its tensors reordered along the last axis, then the one before...; without tensors, the
    first case with an object (a configuration) taken from another case in its place."""
    base = max(runs, key=lambda run: _numbers_in(run.case))   # the first of the largest
    args = base.case.args
    rank = max((arg.dim() for arg in args if isinstance(arg, torch.Tensor)), default=0)
    for back in range(rank):
        yield base, tuple(_flipped(arg, back) for arg in args), "with the same shapes but other numbers"
    if rank == 0:
        for run in runs:
            for i, (mine, other) in enumerate(zip(args, run.case.args)):
                if type(mine) is type(other) and other is not mine and \
                        not isinstance(mine, (numbers.Number, str, bytes, type(None))):
                    yield base, args[:i] + (other,) + args[i + 1:], f"with another {type(other).__name__}"


def _other_numbers(exercise: FunctionExercise, fn: Any, runs: list[Run]) -> None:
    """Every case right: one again, then the same tensors holding other numbers (``_other_inputs``, the first that
    the reference's output shows). A result kept from an earlier call (a cache keyed on the shapes, on the
    tensor's id, on anything but the numbers), or a part of it, shows: ``kept_state``, unless a known mistake
    explains the difference."""
    for base, args, how in _other_inputs(runs):
        if all(a is b for a, b in zip(args, base.case.args)):
            continue
        case = Case(args, base.case.what)
        try:
            expected = exercise.reference(*case.args)
        except (RuntimeError, ValueError):   # inputs this exercise takes only in their order
            continue
        if not exercise.same(expected, base.expected):
            said = how
            break
    else:
        return   # no input to vary, or no order of it that the output shows
    given = base.case.given()
    call_student(fn, *given, what=case.what)
    with torch.no_grad():   # the same tensors, other numbers: a cache on the tensor's id is found out too
        given = tuple(mine.copy_(other) if isinstance(mine, torch.Tensor) else other
                      for mine, other in zip(given, case.args))
    out = call_student(fn, *given, what=case.what)
    out = as_tensor(out) if exercise.numpy_ok else out
    if exercise.same(out, expected):
        return
    if isinstance(out, torch.Tensor) and exercise.same(out, base.expected):
        fail("kept_state", f"{case.what}, called again {said}, returned what it returned the first time: your "
                           f"function {_KEPT}")
    expect_tensor(out, tuple(expected.shape), case.what, dtype=expected.dtype if exercise.dtype else None,
                  finite=exercise.finite)
    _diagnose(exercise, [Run(case, out, expected)], fn, earlier=runs, kept=said)


def kept_part(what: str, how: str, out: torch.Tensor, expected: torch.Tensor) -> str:
    """The ``kept_state`` message of a function right on every case and wrong when called again ``how``."""
    return (f"{what}: right on every case, but called again {how} your result differs from the reference's by up "
            f"to {max_diff(out, expected):.3g}: your function keeps part of its result from an earlier call (a "
            f"cache keyed on the shapes, a value stored on the function or in a global) instead of computing it "
            f"from its inputs each time.")


def _factor(out: Any, expected: torch.Tensor) -> float | None:
    """c where ``out`` is c times ``expected`` (c not 1, and ``expected`` not all zero), else None."""
    if not isinstance(out, torch.Tensor) or out.shape != expected.shape or not out.is_floating_point() \
            or not expected.is_floating_point():
        return None
    got, want = out.detach().double().cpu().flatten(), expected.detach().double().cpu().flatten()
    largest = int(want.abs().argmax())
    if float(want[largest].abs()) < 1e-9:
        return None
    factor = float(got[largest] / want[largest])
    return round(factor, 6) if abs(factor - 1) > 1e-3 and close(got, factor * want) else None


def _numbers(tensor: torch.Tensor) -> int:
    """How many numbers of ``tensor`` are not zero."""
    return int((tensor.detach().abs() > 1e-9).sum()) if tensor.is_floating_point() else 0


def _said(factor: float) -> str:
    """3 times, 1/4 of, 0.37 times."""
    if abs(factor - round(factor)) < 1e-6:
        return f"{round(factor)} times"
    if abs(1 / factor - round(1 / factor)) < 1e-6:
        return f"1/{round(1 / factor)} of"
    return f"{factor:.4g} times"


# Outputs of fewer numbers than this are never named by a mistake that fits one run alone (_one_of_two): a count
# or a score can equal one of many wrong variants by chance, as a tensor of many values cannot.
_FEW = 4


def _one_of_two(exercise: FunctionExercise, runs: list[Run]) -> None:
    """Two mistakes at once: no known mistake explains every run, but one may explain a run on which the other
    has no effect (a scale mistake on a case without a mask). Named with that run; said to be one of two only
    where another run differs in a way it does not explain."""
    differing = [run for run in runs if not exercise.same(run.out, run.expected)]
    for run in differing:
        if not isinstance(run.out, torch.Tensor) or run.out.numel() < _FEW:
            continue   # one number matched by one mistake of many, and missed by it elsewhere, is a coincidence
        if not bool(torch.isfinite(run.out).any()):
            continue   # so is an output with no finite number: many mistakes end in inf or NaN everywhere
        for mistake in exercise.mistakes:
            if _explains(exercise, mistake, run) is not True:
                continue
            message = fill(mistake.message, {"got": quoted(run.out), "expected": quoted(run.expected),
                                             **exercise.values(run)}).rstrip()
            second = any(_explains(exercise, mistake, other) is False for other in differing if other is not run)
            fail(mistake.code, f"{run.case.what}: {message}" + (" On other inputs your output differs in another "
                                                                "way too: there may be a second mistake."
                                                                if second else ""))


def _explains(exercise: FunctionExercise, mistake: Mistake, run: Run) -> bool | None:
    """Whether ``mistake`` gives the student's output on the run; None where it does not apply to that case."""
    try:
        wrong = exercise.mistaken(mistake, run.case)
    except (RuntimeError, ValueError, IndexError):   # a mistake that does not apply to these shapes
        return None
    if wrong is None:
        return None
    return exercise.same(run.out, wrong) if exercise.exact else matches(run.out, wrong)


def _reproduces(exercise: FunctionExercise, mistake: Mistake, run: Run) -> bool:
    return _explains(exercise, mistake, run) is True


def first_mistake(mistakes: Iterable[Mistake], reproduces: Callable[[Mistake], bool], prefix: str = "",
                  **values: Any) -> None:
    """Fail with the first of ``mistakes`` that ``reproduces(mistake)`` says the student's code made, its
    message after ``prefix`` with its placeholders filled from ``values``; return when none does. A mistake
    that does not apply to these inputs (``reproduces`` raises RuntimeError, ValueError or IndexError) is
    passed over."""
    for mistake in mistakes:
        try:
            found = reproduces(mistake)
        except (RuntimeError, ValueError, IndexError):   # a mistake that does not apply to these shapes
            continue
        if found:
            fail(mistake.code, prefix + fill(mistake.message, values))


# {name}, {name!r}, {name:,.0f}: the placeholders a mistake's message may hold
_PLACEHOLDER = re.compile(r"\{(\w+)(![rsa])?(:[^{}]*)?\}")


def fill(message: str, values: Mapping[str, Any]) -> str:
    """``message`` with each placeholder named in ``values`` formatted (``{got:,.0f}``); any other brace is
    left as written, so a message without placeholders is shown as it is."""
    def one(found: re.Match[str]) -> str:
        name, conversion, spec = found.groups()
        if name not in values:
            return found.group(0)
        return ("{0" + (conversion or "") + (spec or "") + "}").format(values[name])
    return _PLACEHOLDER.sub(one, message)


class Number(float):
    """A number in a message: a spec that rounds to a whole number (``,.0f``) shows it in full where it is not
    whole, so a result of 2,663,424.5 never reads as the 2,663,424 expected."""

    def __format__(self, spec: str) -> str:
        if spec.endswith(".0f") and math.isfinite(self) and not self.is_integer():
            spec = spec[:-3]
        return format(float(self), spec)


def quoted(value: Any) -> Any:
    """A run's output as ``{got}``/``{expected}`` quote it: a number for a one-element tensor, else the shape."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return tuple(value.shape)
        value = value.item()
    return Number(value) if isinstance(value, float) else value
