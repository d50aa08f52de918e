"""Reproducibility and device helpers."""
from __future__ import annotations

import os
import random

import torch

from . import _validate as validate

__all__ = ["device", "set_seed", "setup_notebook"]

DEVICES = ("cuda", "mps", "cpu")


def device() -> torch.device:
    """The fastest device here: cuda > mps > cpu, or the one named by ``COURSE_DEVICE``."""
    wanted = os.environ.get("COURSE_DEVICE", "").strip().lower()
    if wanted:
        kind = wanted.split(":")[0]
        if kind not in DEVICES:
            raise ValueError(f"COURSE_DEVICE: expected one of {list(DEVICES)} (optionally 'cuda:N'), "
                             f"got {wanted!r}")
        if kind == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"COURSE_DEVICE={wanted!r} but CUDA is not available here; "
                               f"unset COURSE_DEVICE or set it to 'cpu'")
        if kind == "mps" and not torch.backends.mps.is_available():
            raise RuntimeError(f"COURSE_DEVICE={wanted!r} but Apple MPS is not available here; "
                               f"unset COURSE_DEVICE or set it to 'cpu'")
        return torch.device(wanted)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def set_seed(seed: int) -> torch.Generator:
    """Seed Python, torch (CPU and GPU) and return a CPU generator seeded the same way."""
    validate.non_negative_int("seed", seed)
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def setup_notebook(seed: int = 0) -> torch.device:
    """First cell of every notebook: seed, thread count, device; prints one summary line.

    ``COURSE_THREADS`` fixes the number of CPU threads (the regression runs set it, so
    numbers do not depend on the machine's core count).
    """
    set_seed(seed)
    threads = os.environ.get("COURSE_THREADS", "").strip()
    if threads:
        try:
            count = int(threads)
        except ValueError:
            raise ValueError(f"COURSE_THREADS: expected a whole number of CPU threads, got {threads!r}; "
                             f"set e.g. COURSE_THREADS=2, or unset it to use every core") from None
        torch.set_num_threads(max(1, count))   # as distributed.py reads it: 0 or less means one thread
    chosen = device()
    from . import __version__
    print(f"course_lib {__version__} | torch {torch.__version__.split('+')[0]} | device {chosen} | "
          f"{torch.get_num_threads()} CPU threads | seed {seed}")
    return chosen
