"""The one door to a student's code: calling it (:func:`call`: its exceptions, ``sys.exit`` and in-place changes
to its inputs become verdicts, and course_lib is put back to its pinned references after every call), what
must come back (``expect_*``, :func:`construct`), and :func:`close`, the one tensor comparison, with one
tolerance derived from the dtype. Tolerances that are not about float noise (a prediction rounded by hand in
1.1, a FLOP count in 6.1) stay with their exercise."""
from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..verdict import Failure, fail
from ._pinned import expect_no_new_modes, expect_unpatched, modes_depth
from ._references import install_references
from ._student_files import exception_line, exception_message, is_student_file, student_frame
from .engine.model_state import parameters_changed, parameters_held

# ---------------------------------------------------------------- calling student code

def _tensor_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    named = [(f"argument {i + 1}", a) for i, a in enumerate(args)] + [(f"`{k}`", v) for k, v in kwargs.items()]
    return [(name, value) for name, value in named if isinstance(value, torch.Tensor)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):   # the usual answer in one pass; equal fails on NaN, which the NaN-aware pass takes
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))
                    and torch.equal(torch.isnan(a), torch.isnan(b)))
    return bool(torch.equal(a, b))


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter, which every in-place write bumps, even one that leaves the numbers as they were
    (``ids.clamp_(min=0)`` on valid ids); None for an inference tensor, which keeps none."""
    try:
        return tensor._version
    except RuntimeError:
        return None


CALLS = [0]   # how many times this process called student code: a failure after one may be the student's graph
# The garbage collector's list of callbacks and its thresholds, taken when the course is imported: a callback left
# by the student's code runs at every later collection, inside the check's own code (where a verdict is made).
_GC_CALLBACKS, _GC_THRESHOLD, _SET_GC_THRESHOLD = gc.callbacks, gc.get_threshold, gc.set_threshold


def _collector_put_back(callbacks: tuple[Any, ...], threshold: tuple[int, ...]) -> bool:
    """Put the collector's callbacks and thresholds back as they were before a call; whether they had changed
    (compared by identity and as ints: nothing of the student's runs here)."""
    now = tuple(_GC_CALLBACKS)
    changed = len(now) != len(callbacks) or any(a is not b for a, b in zip(now, callbacks)) \
        or tuple(map(int, _GC_THRESHOLD())) != threshold
    if changed:
        _GC_CALLBACKS[:] = callbacks
        _SET_GC_THRESHOLD(*threshold)
    return changed
_VERDICT_FILE = Failure.__init__.__code__.co_filename


def raised_by_student(failure: Failure) -> bool:
    """Whether the student's own code raised this Failure (``raise Failure(...)`` or ``fail(...)`` written in it),
    not a course function it called (a recording cache the check handed over, which fails on misuse)."""
    tb = failure.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame if tb is not None else None
    while frame is not None and frame.f_code.co_filename == _VERDICT_FILE:   # fail() raises for its caller
        frame = frame.f_back
    return frame is not None and is_student_file(frame.f_code.co_filename)


def call(fn: Callable[..., Any], *args: Any, what: str = "your code", **kwargs: Any) -> Any:
    """Call student code. Its exceptions, ``sys.exit`` and in-place changes to its tensor inputs
    become a Failure with a readable message."""
    CALLS[0] += 1
    inputs = [(name, value, value.detach().clone(), _version(value)) for name, value in _tensor_args(args, kwargs)]
    layer = _layer_of(fn)
    weights = parameters_held(layer) if layer is not None else {}
    depth, settings = modes_depth(), (None if _WITH_BLOCK_STEP[0] else settings_now())
    collector = tuple(_GC_CALLBACKS), tuple(map(int, _GC_THRESHOLD()))
    try:
        try:
            result = fn(*args, **kwargs)
        finally:
            collected = _collector_put_back(*collector)   # first: no callback of theirs runs in what follows
            install_references()   # student code that patched course_lib must not change the verdict
            # put back at once, not only when the check ends: the check's own tensors follow the default too
            left = settings_put_back(settings) if settings is not None else []
        if collected:
            fail("patched", f"{what} changed the garbage collector's callbacks or thresholds (gc.callbacks, "
                            f"gc.set_threshold): a callback runs code of yours inside the check itself. Remove "
                            f"that code, restart the kernel (Kernel > Restart) and run the cells again.")
        _expect_no_setting_left(left, what)
        expect_unpatched()   # nor one that replaced torch's own functions (torch.equal = ...)
        expect_no_new_modes(depth)   # nor a torch mode left on the stack
        result = plain_tensors(result, what)
    except Failure as failure:
        if raised_by_student(failure):   # a verdict is the checker's to give: the student's is an exception
            fail("exception", f"{what} raised the course's Failure itself{student_frame(failure)}: a check's "
                              f"verdict cannot come from the code it checks. Return your result instead.")
        raise
    except NotImplementedError as exc:
        fail("not_implemented", f"{what} is not written yet ({exception_message(exc) or 'NotImplementedError'}). "
                                f"Replace the `raise NotImplementedError` with your solution, then run this cell again.")
    except SystemExit as exc:
        fail("exception", f"{what} called sys.exit({'' if exc.code is None else repr(exc.code)}) (or exit()): "
                          f"that would stop the notebook's kernel. Return a value instead.")
    except Exception as exc:  # any student error becomes a message
        fail("exception", f"{what} raised {exception_line(exc)}")
    for name, value, before, version in inputs:
        changed = not _same(value.detach(), before)
        if changed or _version(value) != version:
            fail("mutation", f"{what} {'changed' if changed else 'wrote into'} its input ({name}) in place, for "
                             f"example with `x += ...`, `q /= ...`, `t[...] = ...` or `ids.clamp_(...)`"
                             + ("" if changed else " (its numbers happened to stay the same here; with other "
                                                   "inputs they would not)")
                             + ". The caller still needs that tensor (and autograd fails when a tensor saved for "
                               "backward is overwritten): write `x = x + ...` instead.",
                 argument=name)
    if weights:
        _expect_weights_left_alone(layer, weights, what)
    return result


# The process-wide settings a function may not leave changed (read, write, name): a training recipe may choose its
# matmul precision or determinism for good, but no exercise changes the default dtype or turns gradients off.
_SETTINGS = ((torch.get_default_dtype, torch.set_default_dtype, "torch.get_default_dtype()"),
             (torch.is_grad_enabled, torch.set_grad_enabled, "torch.is_grad_enabled()"))


_WITH_BLOCK_STEP = [0]   # > 0 while a student's __enter__ or __exit__ runs


@contextlib.contextmanager
def with_block_step() -> Iterator[None]:
    """Around a student's ``__enter__`` or ``__exit__``: a setting it changes is the block's own until the block
    ends (``torch.no_grad()`` is such a block), so it is neither put back nor a verdict there; the check that runs
    the block judges what its body sees and what its end leaves."""
    _WITH_BLOCK_STEP[0] += 1
    try:
        yield
    finally:
        _WITH_BLOCK_STEP[0] -= 1


def settings_now() -> tuple[Any, ...]:
    """The process-wide settings no exercise may leave changed, as they are now."""
    return tuple(read() for read, _, _ in _SETTINGS)


def expect_settings_as(before: tuple[Any, ...], what: str) -> None:
    """``global_setting`` when a setting is no longer as ``before`` (``settings_now()``); put back either way."""
    _expect_no_setting_left(settings_put_back(before), what)


def _expect_no_setting_left(left: list[str], what: str) -> None:
    if left:
        fail("global_setting", f"{what} changed a setting of the whole process and left it changed: "
                               f"{'; '.join(left)}. Every later cell of your notebook, training included, would "
                               f"run with it. Make your tensors with dtype= and device= (or torch.zeros_like) "
                               f"instead of changing the default, and turn gradients off for a block only "
                               f"(with torch.no_grad():), never for the process.")


def settings_put_back(before: tuple[Any, ...]) -> list[str]:
    """Put the settings back as they were before a call; what the call had changed, as 'name was a, is b'."""
    left = []
    for (read, write, name), value in zip(_SETTINGS, before):
        now = read()
        if now != value:
            write(value)
            left.append(f"{name} was {value}, is now {now}")
    return left


def _layer_of(fn: Any) -> nn.Module | None:
    """The module a call runs: the module itself or the owner of a bound method (``model.forward``)."""
    owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def _expect_weights_left_alone(layer: nn.Module, weights: dict[str, Any], what: str) -> None:
    """``mutation`` when a forward changed one of its module's parameters in place (a ``clamp_``, ``abs_``,
    ``mul_`` or ``.data = ...`` on a weight): the values fed to the next call, the optimizer and a checkpoint."""
    changed = parameters_changed(layer, weights)
    if changed:
        name, how = changed[0]
        fail("mutation", f"{what}: your forward changes self.{name} in place ({how}): after one call the layer's "
                         f"weight is no longer the one it was given, so the next call, the optimizer and a saved "
                         f"checkpoint all see other numbers. forward only reads its weights: use them as they are "
                         f"(no clamp_, abs_, mul_, copy_ or .data = on them; a weight may be negative or zero), and "
                         f"build any changed copy as a new tensor (w = self.weight * 2).", parameter=name)


# More numbers than any check's answer holds (its inputs are small): a tensor this large is a slip, not an answer.
_MOST_NUMBERS = 2 ** 27


def plain_tensors(value: Any, what: str = "your code") -> Any:
    """A tensor of a subclass of the student's as a plain tensor (the same numbers), in tuples and lists too: a
    subclass's ``__torch_function__`` would answer the check's own comparisons (``torch.equal`` -> True). Judged
    by the real class (``type``): ``isinstance`` asks the object's ``__class__``, which any object can fake, and
    an object that claims to be a tensor without being one is refused (``dtype``)."""
    kind = type(value)
    if issubclass(kind, torch.Tensor):
        if kind not in (torch.Tensor, nn.Parameter):
            with torch._C.DisableTorchFunctionSubclass():   # the subclass's own as_subclass is not asked
                value = torch.Tensor.as_subclass(value, torch.Tensor)
        if value.layout != torch.strided or value.is_nested:   # the check's comparisons are for dense tensors
            fail("dtype", f"{what} returned a {'nested' if value.is_nested else str(value.layout)} tensor. Return "
                          f"an ordinary dense tensor (.to_dense(), or built without torch.sparse / torch.nested).")
        if value.is_meta:   # shapes without numbers: nothing to compare, and .item() raises
            fail("device", f"{what} returned a tensor on the meta device, which holds a shape but no numbers. "
                           f"Compute it on the device of the inputs (x.device).")
        if value.numel() > _MOST_NUMBERS:   # an expanded view of a few numbers: comparing it would fill memory
            fail("shape", f"{what} returned a tensor of shape {tuple(value.shape)}, {value.numel():,} numbers: far "
                          f"more than the check's inputs could give. Check the shapes you build (an expand or a "
                          f"broadcast over the wrong axes).")
        return value
    if issubclass(kind, (tuple, list)):   # a subclass's own methods are not asked either: plain containers
        return (tuple if issubclass(kind, tuple) else list)(plain_tensors(v, what) for v in value)
    if isinstance(value, torch.Tensor):
        fail("dtype", f"{what} returned an object of class {kind.__name__} that claims to be a torch.Tensor (its "
                      f"__class__ says so) without being one. Return a real tensor, built with torch operations.")
    return value


def reraise_with(failure: Failure, diagnosis: str, extra: str) -> None:
    message = failure.message.rstrip()
    if not message.endswith((".", "!", "?")):
        message += "."
    raise Failure(diagnosis, message + extra, **failure.details)


_VIEW_TIP = (" Tip: after a transpose the tensor is no longer contiguous in memory, so .view cannot "
             "reshape it; .reshape (or .contiguous() before .view) can.")


def call_student(fn: Callable[..., Any], *args: Any, what: str, **kwargs: Any) -> Any:
    """call() with long library errors cut to their first line, plus a tip for the error every student meets."""
    try:
        return call(fn, *args, what=what, **kwargs)
    except Failure as failure:
        if failure.diagnosis != "exception":
            raise
        first, _, rest = failure.message.partition("\n")
        if rest.strip():
            failure = Failure("exception", first.rstrip() + " [...]", **failure.details)
        if "view size is not compatible" in failure.message:
            reraise_with(failure, "exception", _VIEW_TIP)
        raise failure


def expect_callable(candidate: Any, name: str, kind: str = "function") -> None:
    """Students sometimes pass the result, or an instance, instead of what they wrote."""
    if kind == "class" and isinstance(candidate, nn.Module):
        fail("exception", f"You passed an instance of your module; pass the class itself, {name}, so the "
                          f"checker can build it with its own sizes.")
    if not callable(candidate):
        itself = f"{name} itself" + (" (an nn.Module subclass)" if kind == "class" else "")
        fail("exception", f"Expected your {kind} {itself}, got {type(candidate).__name__}: pass the {kind}, "
                          f"not the result of calling it.")


# ---------------------------------------------------------------- what must come back

def expect_cpu(value: torch.Tensor, what: str, device: torch.device | str | None = None) -> None:
    """Checks run on the CPU (the harness clears any default device), so results belong there too."""
    expected = torch.device(device or "cpu")
    if value.device.type != expected.type:
        fail("device", f"{what} returned a tensor on {value.device}, but its inputs are on {expected}: create "
                       f"new tensors with `device=x.device` (or `torch.zeros_like(x)`), and do not move the "
                       f"result with .to(...) / .cuda().")


def expect_finite(value: torch.Tensor, what: str) -> None:
    if value.is_floating_point() and not torch.isfinite(value).all():
        fail("nan", f"{what} returned NaN or infinite values. Find the first step that makes them: a softmax over "
                    f"scores that are all -inf (a softmax along the wrong axis, over the queries or the heads, "
                    f"where a key hidden from every query is a whole line of -inf; or a query that sees no key), "
                    f"a division by zero or by a NaN statistic (the std of one number), a log of zero, or exp of a "
                    f"large number. The softmax runs over the keys, the last axis.")


def _kind(value: Any) -> str:
    module = type(value).__module__
    return type(value).__name__ if module == "builtins" else module.split(".")[0] + "." + type(value).__name__


def expect_tensor(value: Any, shape: tuple[int, ...], what: str, *, dtype: torch.dtype | None = None,
                  device: torch.device | None = None, finite: bool = True) -> torch.Tensor:
    """A returned value must be a tensor of the given shape (dtype, device), with finite numbers.

    ``finite=False`` leaves NaN for later: the attention checkers first look for a known mistake,
    which says more than "NaN" (a mask applied after the softmax gives NaN too)."""
    if not isinstance(value, torch.Tensor):
        if value is None:
            fail("shape", f"{what} should return a torch.Tensor of shape {shape}, but returned nothing "
                          f"(did you forget `return`?).")
        if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
            extra = " It looks like you return several things: return only the output tensor."
        else:
            extra = " Build the result with torch operations (or convert it with torch.as_tensor)."
        fail("dtype", f"{what} should return a torch.Tensor of shape {shape}, but returned a {_kind(value)}.{extra}")
    if tuple(value.shape) != tuple(shape):
        fail("shape", f"{what} returned shape {tuple(value.shape)}, expected {tuple(shape)}.",
             got=tuple(value.shape), expected=tuple(shape))
    expect_cpu(value, what, device)
    if dtype is not None and value.dtype != dtype:
        fail("dtype", f"{what} returned dtype {value.dtype}, expected {dtype} (the dtype of its inputs).")
    if finite:
        expect_finite(value, what)
    return value


def construct(cls: Any, *args: Any, what: str, shown: str | None = None, **kwargs: Any) -> nn.Module:
    """Instantiate a student's class; it must give an nn.Module. ``shown`` is the call as messages
    name it (default ``what(...)``)."""
    shown = shown or f"{what}(...)"
    if not callable(cls):
        fail("exception", f"Pass the class itself (e.g. `{what}`), not {type(cls).__name__}: it should be an "
                          f"nn.Module subclass.")
    if isinstance(cls, nn.Module):
        fail("exception", f"You passed an instance of your module ({type(cls).__name__}); pass the class itself, "
                          f"so the checker can build it with its own sizes.")
    what_built = f"{shown} (the constructor)"
    try:
        module = call(cls, *args, what=what_built, **kwargs)
    except Failure as failure:   # a tensor that comes back is judged as a result: here it is no module at all
        if failure.diagnosis in ("device", "dtype", "shape") and failure.message.startswith(f"{what_built} returned"):
            fail("exception", f"{shown} should build an nn.Module, but gave a tensor. Pass the class (not a "
                              f"function that computes something) and keep `super().__init__()` in the constructor.")
        raise
    if not issubclass(type(module), nn.Module):   # its real class: a __class__ of its own is not read here
        fail("exception", f"{shown} should build an nn.Module, but gave {type(module).__name__}. "
                          f"Pass the class (not an instance) and keep `super().__init__()` in the constructor.")
    try:
        _CONSTRUCTOR_BUFFERS[module] = frozenset(name for name, _ in module.named_buffers())
    except Exception:  # noqa: BLE001 - a module whose buffers cannot be listed: every buffer is judged
        pass
    return module


# The buffers each module had when its constructor returned: a forward may record what it likes in buffers of its
# own making (the last attention weights), but a buffer the constructor made (a mask) is what every call reads.
_CONSTRUCTOR_BUFFERS: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()


def _names(names: list[str]) -> str:
    return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")


def expect_parameters(model: nn.Module, expected: dict[str, tuple[int, ...]], what: str, advice: str, *,
                      diagnosis: str = "shape") -> None:
    """A student's module must have exactly these parameters, by name and shape: the checker copies the
    reference's weights into it by name. ``advice`` says how the constructor should build them;
    ``diagnosis`` is the one a wrong set of names gets (a wrong shape is always ``shape``)."""
    try:
        got = {name: tuple(p.shape) for name, p in model.named_parameters()}
    except Exception as exc:  # a broken module is the student's to fix
        fail("exception", f"Listing the parameters of {what} raised {exception_line(exc)}")
    missing = [name for name in expected if name not in got]
    extra = [name for name in got if name not in expected]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"no parameter {_names(missing)}")
        if extra:
            bias = any(name.endswith(".bias") for name in extra)
            parts.append(f"unexpected parameter(s) {_names(extra)}" +
                         (" (the course's linear layers use bias=False)" if bias else ""))
        fail(diagnosis, f"{what} has {' and '.join(parts)}. {advice}", found=sorted(got))
    for name, shape in expected.items():
        if got[name] != shape:
            fail("shape", f"Parameter {name} of {what} has shape {got[name]}, expected {shape}. {advice}")


def load_parameters(model: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Copy weights into a student's module by parameter name (the names were checked before)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])


def module_output(model: nn.Module, x: torch.Tensor, what: str, *, params: dict[str, torch.Tensor] | None = None,
                  train_seed: int | None = None) -> torch.Tensor:
    """A student's module on x, without gradients: a tensor of x's shape and dtype comes back.
    NaN is left for the caller, which first looks for a known mistake that explains it.

    ``params`` runs the module with these weights (by name) and gives it its own back afterwards.
    ``train_seed`` runs it in training mode, with torch's generator seeded so that every call draws
    the same dropout masks, and puts it back in eval mode afterwards.
    """
    own = {name: p.detach().clone() for name, p in model.named_parameters()} if params is not None else None
    try:
        if params is not None:
            load_parameters(model, params)
        if train_seed is not None:
            call(model.train, what=f"model.train() before {what}")
            torch.manual_seed(train_seed)
        before = _own_state(model)
        with torch.no_grad():
            out = call_student(model, x.clone(), what=what)
        _expect_state_kept(model, before, what)
    finally:
        if train_seed is not None:
            model.eval()
        if own is not None:
            load_parameters(model, own)
    return expect_tensor(out, tuple(x.shape), what, dtype=x.dtype, finite=False)


def _own_state(model: nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """The module's parameters and buffers (their values) by name, as a forward must leave them."""
    try:
        return {**{name: ("weight", p.detach().clone()) for name, p in model.named_parameters()},
                **{name: ("buffer", b.detach().clone()) for name, b in model.named_buffers()}}
    except Exception:  # noqa: BLE001 - a module that cannot list them fails where it is called
        return {}


def _expect_state_kept(model: nn.Module, before: dict[str, tuple[str, torch.Tensor]], what: str) -> None:
    """A forward computes from the module's weights and buffers and leaves them as they were: a mask buffer cut to
    this call's length, or a weight changed in place, is what the next call finds (``kept_state``)."""
    after, made = _own_state(model), _CONSTRUCTOR_BUFFERS.get(model)
    for name, (kind, old) in before.items():
        new = after.get(name, (kind, None))[1]
        if new is None or (kind == "buffer" and made is not None and name not in made):
            continue   # gone (the parameter checks name it), or a buffer the forward made to record something
        if kind == "buffer" and new.shape != old.shape and _cut_from(old, new):
            fail("kept_state", f"{what}: your forward replaced the buffer `{name}` of shape {tuple(old.shape)} by one "
                               f"of shape {tuple(new.shape)}, so the next call finds it cut (a longer input no "
                               f"longer fits). Cut it into a local variable, mask = self.{name}[:L, :L], and leave "
                               f"the buffer as the constructor made it.")
        if kind == "weight" and (new.shape != old.shape or not bool(torch.equal(new, old))):
            fail("kept_state", f"{what}: your forward changed the weight `{name}` in place, so the next call (and the "
                               f"optimizer) finds other numbers. A forward reads its weights: compute with them, "
                               f"never write to them.")


def _cut_from(old: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether ``new`` is ``old`` cut to a corner (mask[:L, :L]), what the next, longer call no longer fits; a buffer
    that records something else at each call (the last attention weights) is the module's own business."""
    if new.dim() != old.dim() or any(n > o for n, o in zip(new.shape, old.shape)) or new.device != old.device:
        return False
    if old.is_meta or new.is_meta:
        return True   # no numbers to compare: a buffer that shrank is read as cut
    corner = old[tuple(slice(0, n) for n in new.shape)]
    # one number alone proves nothing (the first query's causal weight is always 1), one flag of a mask does
    return corner.dtype == new.dtype and bool(torch.equal(corner, new)) and (new.numel() > 1 or new.dtype == torch.bool)


# ---------------------------------------------------------------- comparing with the reference

# Why 1e-3 relative (1e-4 absolute) for float32 and float64 alike: the student's code and the
# reference compute the same thing in a different order (another reduction order, softmax written
# out, a float32 constant in a float64 notebook), which moves float32 results by up to ~1e-5
# relative after softmax, layer norm and gradients. The mistakes the checkers diagnose (a missing
# scale, a leaked mask, a wrong axis) move outputs by 1e-2 or more, so 1e-3 sits safely between.
# Half precision rounds far more coarsely, so the tolerance grows with the dtype's resolution.
_FLOOR_RTOL = 1e-3
_EPS_FACTOR = 8          # a few roundings of the coarsest dtype in the comparison


def tolerance(*tensors: torch.Tensor) -> tuple[float, float]:
    """(rtol, atol) for comparing these tensors: from the coarsest floating dtype among them."""
    eps = max((torch.finfo(t.dtype).eps for t in tensors if t.is_floating_point()), default=0.0)
    rtol = max(_FLOOR_RTOL, _EPS_FACTOR * eps)
    return rtol, rtol / 10


_ROUNDINGS = (("round", torch.round), ("trunc", torch.trunc), ("floor", torch.floor), ("ceil", torch.ceil))


def rounding_of(got: torch.Tensor, wanted: torch.Tensor) -> str | None:
    """How ``got`` holds ``wanted``'s numbers rounded, both sorted (an exercise that only moves numbers about):
    "rounds them to whole numbers (...)", "computes in a lower precision (...)", or None when it does not."""
    got, wanted = got.detach().double().flatten().sort().values, wanted.detach().double().flatten().sort().values
    if got.shape != wanted.shape:
        return None
    rounded = [f".{name}()" for name, rounding in _ROUNDINGS if torch.equal(got, rounding(wanted))]
    if rounded:   # each rounding is monotone: the rounded numbers come in the same order
        return f"rounds them to whole numbers ({', '.join(rounded)}, or a detour through an integer dtype)"
    if torch.allclose(got, wanted, rtol=1e-2, atol=1e-2):
        return "computes in a lower precision (.half(), .bfloat16(), .float() on float64 inputs)"
    return None


# A float64 pass (a float64 notebook, float64 inputs) meets float64 with float64: a reordering moves the two by
# about 1e-15, a float32 step on the way (a float32 constant, 9.3's hint's x.float()) by up to ~1e-5 relative, and
# a float16 or bfloat16 one by 5e-4 or more. 1e-4 keeps the first two right and tells the third, which
# tolerance()'s floor cannot.
_FLOAT64_RTOL = 1e-4


def close_in_float64(a: object, b: torch.Tensor) -> bool:
    """:func:`close`, at the float64 pass's tolerance where both are float64 tensors."""
    if not isinstance(a, torch.Tensor) or a.dtype != torch.float64 or b.dtype != torch.float64 or a.shape != b.shape:
        return close(a, b)
    return bool(torch.allclose(a.detach().cpu(), b.detach().cpu(), rtol=_FLOAT64_RTOL, atol=_FLOAT64_RTOL / 10))


def coarse_precision(out: object, expected: torch.Tensor) -> bool:
    """Right to the rounding of half precision (float16, bfloat16: 3 significant digits or fewer) but not to the
    inputs' own: part of the computation ran in a lower precision, or rounded. Rounding makes magnitudes both
    grow and shrink; a result whose magnitudes all move one way (scaled by 1.01) is a mistake, not a rounding."""
    if not isinstance(out, torch.Tensor) or out.shape != expected.shape or close(out, expected):
        return False
    got, want = out.detach().double().cpu(), expected.detach().double().cpu()
    if not bool(torch.isfinite(got).all()):
        return False
    for digits in range(2, 7):   # rounded to a decimal grid: (x * 100).round() / 100, x.round(decimals=3)
        grid = got * 10.0 ** digits
        if bool(torch.allclose(grid, grid.round(), rtol=0, atol=1e-6)):
            return bool((got - want).abs().max() <= 0.5 * 10.0 ** -digits + 1e-9)
    if not bool(torch.allclose(got, want, rtol=3e-2, atol=3e-3)):
        return False
    moved = (got - want).abs() > 1e-6 + 1e-4 * want.abs()                 # the entries rounding moved
    outward = ((got - want) * want.sign())[moved]                          # > 0: the magnitude grew
    above = float((outward > 0).double().mean()) if outward.numel() else 0.5
    return 0.2 <= above <= 0.8


HALF_PRECISION = ("your result is right to about three significant digits only: part of your computation runs in "
                  "half precision or rounds (.half(), torch.float16, torch.bfloat16, an autocast, a .round()). "
                  "Keep the inputs' dtype throughout (create new tensors with dtype=x.dtype or torch.zeros_like).")


def close(a: object, b: object, *, nan_ok: bool = False) -> bool:
    """Both tensors, same shape, same numbers up to :func:`tolerance` (NaN matches NaN only when ``nan_ok``)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.shape != b.shape:
        return False
    rtol, atol = tolerance(a, b)
    return bool(torch.allclose(a.detach().double().cpu(), b.detach().double().cpu(), rtol=rtol, atol=atol,
                               equal_nan=nan_ok))


def matches(out: torch.Tensor, hypothesis: torch.Tensor) -> bool:
    """Does the student's output match a mistake's output? Where the mistake leaves a query with no key
    at all its output is undefined (NaN here, zeros from F.scaled_dot_product_attention): either counts."""
    if out.shape != hypothesis.shape:
        return False
    undefined = torch.isnan(hypothesis)
    loose = out[undefined]
    if not bool((torch.isnan(loose) | (loose == 0)).all()):
        return False
    return close(out[~undefined], hypothesis[~undefined])


def sums_to_one(w: torch.Tensor, dim: int) -> bool:
    """Whether the weights along ``dim`` sum to one (attention weights, probabilities)."""
    total = w.sum(dim)
    return close(total, torch.ones_like(total))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest finite difference, for messages."""
    diff = (a.double() - b.double()).abs()
    diff = diff[torch.isfinite(diff)]
    return float(diff.max()) if diff.numel() else float("nan")
