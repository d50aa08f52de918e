"""Leaving the caller's random numbers alone.

A call that is not about randomness (converting a model, saving it, training a demonstration model with
its own seed) must not move the notebook's random streams: the next ``torch.randn`` a student writes
would otherwise give other numbers than the notebook's text shows. :func:`preserved` saves every global
stream a call could draw from (torch's CPU generator, the current CUDA device's once initialised, Python's
``random`` and NumPy's global one) and puts them back however the call ends.
"""
from __future__ import annotations

import functools
import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def preserved() -> Iterator[None]:
    """Inside, draw freely (or reseed); afterwards every global random stream is where it was."""
    # never initialise CUDA just to save it; only the current GPU's (touching every GPU would make each
    # torchrun rank a context on all of them)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    torch_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state() if cuda else None
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")   # only if something imported it: no import for our sake
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state)
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


def leaves_rng_alone(fn: F) -> F:
    """Decorate a public function so that it leaves the caller's random streams as they were."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with preserved():
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]
