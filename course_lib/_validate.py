"""Argument checks shared by the public API.

Every message names the argument, says what was expected and what was given,
so a student reading the traceback knows which line of theirs to change.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Sequence
from numbers import Integral, Real
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def _then(hint: str) -> str:
    return f"; {hint}" if hint else ""


def describe(value: Any) -> str:
    """A short description of a value for an error message."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if type(value).__module__ == "numpy" and hasattr(value, "ndim") and value.ndim > 0:
        return f"a {value.dtype} array of shape {value.shape}"
    if isinstance(value, (list, tuple)) and len(value) > 6:
        return f"a {type(value).__name__} of length {len(value)}"
    if isinstance(value, torch.nn.Module):
        # a model's repr is pages long: its class says which object was passed
        return f"a {type(value).__name__} (nn.Module)"
    if isinstance(value, str) and len(value) > _LONGEST_REPR:
        return f"{value[:60]!r}... (str of length {len(value)})"
    text = repr(value)
    if "\n" in text or len(text) > _LONGEST_REPR:
        return f"a {type(value).__name__}"
    return f"{text} ({type(value).__name__})"


_LONGEST_REPR = 200   # longer (or multi-line) reprs are described by their type alone


def tensor(name: str, value: Any, *, min_dim: int = 0, dim: int | None = None,
           floating: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Check that ``value`` is a tensor with the given rank and kind of dtype."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {describe(value)}")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{name}: expected a tensor with {dim} dimension(s), "
                         f"got shape {tuple(value.shape)} ({value.dim()} dimensions)")
    if value.dim() < min_dim:
        raise ValueError(f"{name}: expected at least {min_dim} dimension(s), "
                         f"got shape {tuple(value.shape)}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {value.dtype}; "
                        f"convert it with .float()")
    if dtype is not None and value.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {value.dtype}")
    return value


def token_ids(name: str, value: Any, *, dim: int | None = None, vocab_size: int | None = None,
              padding: int | None = None) -> torch.Tensor:
    """Check that ``value`` is an integer tensor of token ids, each in 0..vocab_size-1 when given.

    ``padding`` (IGNORE_INDEX in targets) is allowed besides the vocabulary.
    """
    tensor(name, value, dim=dim)
    if value.is_floating_point() or value.dtype == torch.bool or value.is_complex():
        raise TypeError(f"{name}: expected integer token ids (torch.long), got dtype {value.dtype}")
    if vocab_size is not None:
        in_vocabulary(name, value if padding is None else value.masked_fill(value == padding, 0), vocab_size)
    return value


def in_vocabulary(name: str, ids: torch.Tensor, vocab_size: int) -> None:
    """Refuse token ids outside 0..vocab_size-1 (the usual tokenizer/model mismatch) with a message."""
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = high if high >= vocab_size else low
        raise ValueError(f"{name}: expected token ids in 0..{vocab_size - 1} (vocab_size={vocab_size}), "
                         f"got {bad}; the tokenizer and the model disagree: build the model with "
                         f"vocab_size=tokenizer.vocab_size (or len(tokenizer))")


def boolean(name: str, value: Any) -> bool:
    """True or False, not a truthy stand-in such as "yes" or 1."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {describe(value)}")
    return value


def is_number(value: Any) -> bool:
    """A real number (numpy's included), and not a bool: True + True is 2, but never meant as one."""
    return isinstance(value, Real) and not isinstance(value, bool)


def finite_number(name: str, value: Any, *, minimum: float | None = None,
                  maximum: float | None = None) -> float:
    """A finite real number in [minimum, maximum], returned as a float."""
    ok = is_number(value) and math.isfinite(value) and (minimum is None or value >= minimum) \
        and (maximum is None or value <= maximum)
    if not ok:
        lo = "-inf" if minimum is None else f"{minimum:g}"
        hi = "inf" if maximum is None else f"{maximum:g}"
        raise ValueError(f"{name}: expected a finite number in [{lo}, {hi}], got {describe(value)}")
    return float(value)


def is_int(value: Any) -> bool:
    """An integer (numpy's included), and not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def positive_int(name: str, value: Any) -> int:
    """A positive int (numpy's included), returned as an int."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {describe(value)}")
    return int(value)


def non_negative_int(name: str, value: Any) -> int:
    """An int >= 0 (numpy's included), returned as an int."""
    if not is_int(value) or value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {describe(value)}")
    return int(value)


def positive_int_or_none(name: str, value: Any) -> int | None:
    """None (the feature is off) or a positive int (numpy's included), returned as an int."""
    if value is None:
        return None
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name}: expected None or a positive int, got {describe(value)}")
    return int(value)


def int_list(name: str, value: Any, *, minimum: int = 1, below: int | None = None) -> list[int]:
    """A non-empty list (or tuple) of ints, each in [minimum, below)."""
    if below is not None:
        what = f"ints in [{minimum}, {below})"
    else:
        what = "positive ints" if minimum == 1 else f"ints >= {minimum}"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"{name}: expected a non-empty list of {what}, got {describe(value)}")
    for item in value:
        if not is_int(item) or item < minimum or (below is not None and item >= below):
            raise ValueError(f"{name}: expected a non-empty list of {what}, got an item {describe(item)}")
    return [int(item) for item in value]


def probability(name: str, value: Any, *, allow_one: bool = False, hint: str = "") -> float:
    """A dropout-like rate in [0, 1) (or [0, 1] with ``allow_one``); ``hint`` ends the message."""
    ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    upper_ok = ok_type and (value <= 1 if allow_one else value < 1)
    if not ok_type or value < 0 or not upper_ok:
        bound = "[0, 1]" if allow_one else "[0, 1)"
        raise ValueError(f"{name}: expected a number in {bound}, got {describe(value)}{_then(hint)}")
    return float(value)


def positive_float(name: str, value: Any, *, finite: bool = False, hint: str = "") -> float:
    """A number > 0 (and not infinite, with ``finite``), returned as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or (finite and not math.isfinite(value)):
        raise ValueError(f"{name}: expected a {'finite ' if finite else ''}number > 0, got "
                         f"{describe(value)}{_then(hint)}")
    return float(value)


def finite_positive(name: str, value: Any, hint: str = "") -> float:
    """A finite number > 0: a value <= 0 or not a number gets positive_float's message, inf its own (a RoPE base
    or a norm's epsilon of inf gives numbers that mean nothing)."""
    positive_float(name, value, hint=hint)
    return positive_float(name, value, finite=True, hint=hint)


def floating_dtype(name: str, value: Any, what: str = "") -> torch.dtype:
    """A floating-point torch.dtype (``what`` says what it holds, in the message)."""
    if not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(f"{name}: expected a floating torch.dtype such as torch.float32{what}, got {describe(value)}")
    return value


def number_in(name: str, value: Any, *, low: float, high: float, low_open: bool = False,
              high_open: bool = False, hint: str = "") -> float:
    """A real number between ``low`` and ``high`` (each end open or closed); ``hint`` ends the message."""
    ok = is_number(value) and (value > low if low_open else value >= low) \
        and (value < high if high_open else value <= high)
    if not ok:
        span = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name}: expected a number in {span}, got {describe(value)}{_then(hint)}")
    return float(value)


def device(name: str, value: Any) -> torch.device:
    """A device that exists here: 'cpu', 'cuda', 'cuda:N', 'mps' or a torch.device, checked before any work."""
    kinds = ("cuda", "mps", "cpu")
    if isinstance(value, bool) or not isinstance(value, (str, torch.device)):
        raise TypeError(f"{name}: expected 'cpu', 'cuda', 'cuda:N', 'mps' or a torch.device, got {describe(value)}")
    try:
        chosen = torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(f"{name}: expected 'cpu', 'cuda', 'cuda:N' or 'mps', got {value!r}") from None
    if chosen.type not in kinds:
        raise ValueError(f"{name}: expected one of {list(kinds)} (optionally 'cuda:N'), got {str(value)!r}")
    if chosen.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: {str(value)!r} asked for, but CUDA is not available here (torch "
                             f"{torch.__version__}); use 'cpu', or leave it out for the fastest device")
        if chosen.index is not None and chosen.index >= torch.cuda.device_count():
            raise ValueError(f"{name}: {str(value)!r} asked for, but this machine has "
                             f"{torch.cuda.device_count()} GPU(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    if chosen.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{name}: {str(value)!r} asked for, but Apple MPS is not available here; "
                         f"use 'cpu', or leave it out for the fastest device")
    return chosen


def path(name: str, value: Any, what: str = "a path") -> Path:
    """A file or folder path given as a str or os.PathLike (not empty), returned as a Path."""
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name}: expected {what} (str or os.PathLike), got {describe(value)}")
    if str(value) == "":
        raise ValueError(f"{name}: expected {what}, got an empty string")
    return Path(value)


def one_of(name: str, value: Any, choices: Iterable[Any]) -> Any:
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {describe(value)}")
    return value


def expect(ok: bool, name: str, expected: str, got: Any, error: type[Exception] = ValueError) -> None:
    """A check in one line: unless ``ok``, raise ``error("{name}: expected {expected}, got {got}")``.

    For the checks that relate one argument to another (keys to match the query, one value per key),
    which the single-argument helpers above cannot say."""
    if not ok:
        raise error(f"{name}: expected {expected}, got {got}")


def divisor(name: str, value: int, total: int, of: str, hint: str = "") -> int:
    """``value`` divides ``total`` (``of`` says what ``total`` is: "embed_dim=64"), as heads split features."""
    if total % value:
        raise ValueError(f"{name}: {of} must be divisible by {name}, got {name}={value}{_then(hint)}")
    return value


def instance(name: str, value: Any, types: type | tuple[type, ...], what: str, *, or_none: bool = False,
             brief: bool = False, hint: str = "") -> Any:
    """``value`` is one of ``types`` (or None, with ``or_none``); the message says ``what`` was expected and
    what was given (its type name alone with ``brief``: a model's repr is pages long)."""
    if (or_none and value is None) or isinstance(value, types):
        return value
    raise TypeError(f"{name}: expected {what}, got {type(value).__name__ if brief else describe(value)}"
                    f"{_then(hint)}")


def config_from_dict(cls: type[T], values: Any) -> T:
    """A config dataclass rebuilt from its ``to_dict()``: a dict whose every key is a field of ``cls``
    (missing ones take their defaults, so a config saved before a field was added still loads)."""
    if not isinstance(values, dict):
        raise TypeError(f"values: expected a dict from {cls.__name__}.to_dict(), got {describe(values)}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; known fields are {sorted(known)}")
    return cls(**values)


def most_threads() -> int:
    """The most CPU threads a count may ask for: 4 per core. Far more makes torch's thread pool fail outright
    (100,000 threads crashed the process with a segmentation fault, 2**31 overflowed torch's int)."""
    return 4 * (os.cpu_count() or 1)


def thread_count(name: str, value: Any) -> int:
    """A number of CPU threads, 1 to :func:`most_threads` (numpy's ints included), returned as an int."""
    if not is_int(value):
        raise TypeError(f"{name}: expected a whole number of CPU threads such as 1 or 2, got {describe(value)}")
    most = most_threads()
    if not 1 <= value <= most:
        raise ValueError(f"{name}: expected 1 to {most} threads (this machine has {os.cpu_count() or 1} cores), "
                         f"got {value}")
    return int(value)


SEED_LIMIT = 2**64   # torch seeds are unsigned 64-bit: a larger seed overflows inside torch.manual_seed


def seed(name: str, value: Any) -> int:
    """A random seed: an int (numpy's included) in 0 .. 2**64 - 1, returned as a Python int (random.seed
    refuses numpy's ints)."""
    non_negative_int(name, value)   # its message for what is no seed at all
    if value >= SEED_LIMIT:
        raise ValueError(f"{name}: expected an int >= 0 and below 2**64, got {describe(value)}")
    return int(value)


def callable_taking(name: str, value: Any, count: int, signature: str) -> Any:
    """A callable that can be called with ``count`` positional arguments; ``signature`` shows the call expected,
    e.g. "(prompt, temperature, top_k, max_new_tokens) -> str". Checked before the first call, so that a
    function of the wrong shape is named here, not by a TypeError from deep inside the caller. A callable
    whose signature cannot be read (some builtins) is taken as it is."""
    import inspect
    if not callable(value):
        raise TypeError(f"{name}: expected a function {signature}, got {describe(value)}")
    try:
        found = inspect.signature(value)
    except (TypeError, ValueError):   # no signature to read: trust it
        return value
    try:
        found.bind(*range(count))
    except TypeError:
        raise TypeError(f"{name}: expected a function {signature} (called with {count} positional arguments), "
                        f"got {getattr(value, '__name__', type(value).__name__)}{found}") from None
    return value


def env_text(name: str, value: Any) -> str:
    """An environment variable's value: a str (os.environ holds nothing else)."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str (environment variables are text, e.g. '1'), got {describe(value)}")
    return value


MOST_STEPS = 10**9   # far beyond any course run (its longest preset takes 5,000): more is an endless run


def steps(name: str, value: Any) -> int:
    """A number of training steps: a positive int (numpy's included) up to :data:`MOST_STEPS`."""
    positive_int(name, value)   # its message for what is no count at all
    if value > MOST_STEPS:
        raise ValueError(f"{name}: expected a positive int up to {MOST_STEPS:,}, got {describe(value)}")
    return int(value)
