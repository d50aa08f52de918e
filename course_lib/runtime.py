"""Reproducibility and device helpers."""
from __future__ import annotations

import math
import os
import random
import time

import torch

from . import _validate as validate

__version__ = "0.1.0"   # the one place of the version: printed by setup_notebook, read by pyproject.toml

__all__ = ["device", "set_seed", "setup_notebook", "set_threads", "choose_threads", "calibrate", "slowdown",
           "expect_time"]

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
        try:
            return torch.device(wanted)
        except (RuntimeError, ValueError):   # torch's own "Invalid device string" would not name the variable
            raise ValueError(f"COURSE_DEVICE: expected 'cpu', 'cuda', 'cuda:N' or 'mps', got {wanted!r}") from None
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def set_seed(seed: int) -> torch.Generator:
    """Seed Python, torch (CPU and GPU) and return a CPU generator seeded the same way."""
    seed = validate.seed("seed", seed)   # a Python int: random.seed refuses numpy's, torch overflows past 2**64
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def course_threads() -> int | None:
    """``COURSE_THREADS`` as a number of CPU threads (0 or less: one), None when it is not set; a value that is
    not a whole number is refused, naming the variable."""
    threads = os.environ.get("COURSE_THREADS", "").strip()
    if not threads:
        return None
    try:
        count = max(1, int(threads))
    except ValueError:
        raise ValueError(f"COURSE_THREADS: expected a whole number of CPU threads, got {threads!r}; set e.g. "
                         f"COURSE_THREADS=2, or unset it to use every core") from None
    return validate.thread_count("COURSE_THREADS", count)   # far too many threads crash torch


def setup_notebook(seed: int = 0) -> torch.device:
    """First cell of every notebook: seed, thread count, device; prints one summary line.

    ``COURSE_THREADS`` fixes the number of CPU threads (the regression runs set it, so
    numbers do not depend on the machine's core count); then nothing is measured or changed.
    Without it, a CPU that calibrates as crowded (other programs using the cores) gets the thread
    count that runs small operations fastest here, measured (``choose_threads``), and a line saying
    what was chosen and how to change it mid-notebook (``set_threads``).
    """
    set_seed(seed)
    threads = course_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    chosen = device()
    choice = None
    if threads is None and chosen.type == "cpu" and torch.get_num_threads() > 1 and slowdown() > CROWDED_SLOWDOWN:
        choice = choose_threads()
        _state.pop("slowdown", None)           # compare this machine as it now runs, with the chosen threads
    print(f"course_lib {__version__} | torch {torch.__version__.split('+')[0]} | device {chosen} | "
          f"{torch.get_num_threads()} CPU threads | seed {seed}")
    print(_compare_with_reference(chosen, advise=choice is None))
    if choice is not None:
        print(choice.message())
    return chosen


# ---------------------------------------------------------------------------
# Threads on a crowded machine
# ---------------------------------------------------------------------------

# Beyond this slowdown against the reference laptop, the cores are probably shared with other work. Then
# threads wait on each other at every small operation: on a loaded 2-core machine two threads made small-op
# cells 10 to 20 times slower than one (notebook 09's RoPE cell 89 s against 4 s). So it is measured.
CROWDED_SLOWDOWN = 3.0


class ThreadChoice:
    """What ``choose_threads`` measured: seconds of the small-op step per thread count, and the count chosen."""

    def __init__(self, seconds: dict[int, float], chosen: int, before: int):
        self.seconds, self.chosen, self.before = dict(seconds), chosen, before

    def message(self) -> str:
        timed = ", ".join(f"{count} thread{'s' if count > 1 else ''} {seconds * 1000:.1f} ms"
                          for count, seconds in sorted(self.seconds.items()))
        others = [count for count in sorted(self.seconds) if count != self.chosen]
        other = self.before if self.chosen != self.before else (others[0] if others else self.chosen)
        verb = "chosen" if self.chosen != self.before else "kept"
        return (f"threads: {self.chosen} {verb}, the fastest here for small operations ({timed} a step); "
                f"to change it in this notebook: course_lib.runtime.set_threads({other})")

    def __repr__(self) -> str:
        return f"ThreadChoice(chosen={self.chosen}, seconds={self.seconds})"


def set_threads(count: int) -> int:
    """Use ``count`` CPU threads from now on in this Python process (the notebook's kernel); returns it.

    For a machine shared with other work, mid-notebook: ``course_lib.runtime.set_threads(1)``.
    """
    if not validate.is_int(count):
        raise TypeError(f"count: expected a whole number of CPU threads such as 1 or 2, got {count!r}")
    if count < 1:
        raise ValueError(f"count: expected a whole number of CPU threads >= 1, got {count}")
    count = validate.thread_count("count", count)   # far too many threads crash torch's thread pool
    torch.set_num_threads(count)
    _state.pop("slowdown", None)               # the machine now runs differently: calibrate again when asked
    return torch.get_num_threads()


def _small_op_step(generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Tensors for one small training-like step: the sizes of the course's CPU models (width 64, 32 tokens)."""
    x = torch.randn(4, 32, 64, generator=generator)               # (N, L, E)
    w = torch.randn(64, 192, generator=generator) / 8             # (E, 3E): a fused q, k, v projection
    return x, w.requires_grad_()


def _time_small_ops(count: int, tensors: tuple[torch.Tensor, ...], repeats: int, budget: float = 0.25) -> float:
    """Median seconds of one small-op step (projection, scores, softmax, layer norm, backward) on ``count`` threads.

    At most ``repeats`` steps, and no more once ``budget`` seconds are spent: on a crowded machine a thread count
    that waits can take half a second a step, and the first cell must stay quick.
    """
    x, w = tensors
    torch.set_num_threads(count)
    times: list[float] = []
    while len(times) < repeats and sum(times) < budget:
        start = time.perf_counter()
        q, k, v = (x @ w).split(64, dim=-1)                       # (N, L, E) each
        scores = torch.softmax(q @ k.transpose(-2, -1) / 8, dim=-1)   # (N, L, L)
        out = torch.nn.functional.layer_norm(scores @ v, (64,))   # (N, L, E)
        out.square().mean().backward()
        w.grad = None
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def choose_threads(candidates: list[int] | None = None, repeats: int = 15) -> ThreadChoice:
    """Measure a small-op step on each thread count, in turns, and keep the fastest; returns what it measured.

    ``candidates`` defaults to 1, 2 and the current count (no more than it). Turns, not one count after the
    other, so that a machine whose load changes moves every count alike. The notebook's random stream is
    untouched (the step draws from its own generator).
    """
    before = torch.get_num_threads()
    if candidates is None:
        candidates = sorted({1, min(2, before), before})
    candidates = validate.int_list("candidates", candidates)
    for count in candidates:   # far too many threads crash torch's thread pool
        validate.thread_count("candidates", count)
    repeats = validate.positive_int("repeats", repeats)
    tensors = _small_op_step(torch.Generator().manual_seed(0))
    samples: dict[int, list[float]] = {count: [] for count in candidates}
    try:
        for count in candidates:                                   # a first, untimed round: threads start up
            _time_small_ops(count, tensors, 1)
        for _ in range(3):
            for count in candidates:
                samples[count].append(_time_small_ops(count, tensors, repeats))
    finally:
        torch.set_num_threads(before)
    seconds = {count: sorted(times)[1] for count, times in samples.items()}   # the middle of three turns
    chosen = min(seconds, key=lambda count: (seconds[count], count))
    torch.set_num_threads(chosen)
    return ThreadChoice(seconds, chosen, before)


# ---------------------------------------------------------------------------
# How this machine compares with the reference laptop
# ---------------------------------------------------------------------------

# The notebooks' times are for the reference laptop: a quiet 2-core CPU running 2 threads. On it,
# calibrate() measures about this many GFLOP/s. Measured on the CI machine kind (2 vCPUs Xeon, torch 2.13
# CPU, 2 threads) in its calmest moments, medians of 180 to 197: an estimate, as that machine was shared
# while this was written; measure it again on a quiet one with `python -c "from course_lib import
# runtime; print(runtime.calibrate(1.0))"` (COURSE_THREADS=2 set by setup_notebook, or torch's default).
REFERENCE_GFLOPS = 190.0
# Threads that wait on each other on a crowded machine make small matmuls hundreds of times slower, far
# more than a whole training step, so beyond this the comparison only says "more than".
MOST_SLOWDOWN_SHOWN = 20.0
_CALIBRATION_SIZE = 256        # (256, 256) @ (256, 256): about the size of the CPU models' own matmuls
_state: dict[str, float] = {}
MOST_CALIBRATION_SECONDS = 60.0


def calibrate(seconds: float = 0.2) -> float:
    """This machine's float32 matmul speed now, in GFLOP/s: (256, 256) matmuls for about ``seconds``.

    The median of many short products, so one interruption does not decide it, but a machine
    busy with other work (or threads waiting on each other) measures slow, as its runs will be.
    """
    # finite and bounded: the loop below runs for ``seconds``, so inf (or 1e308) would never end
    validate.positive_float("seconds", seconds, finite=True)
    validate.expect(seconds <= MOST_CALIBRATION_SECONDS, "seconds", f"at most {MOST_CALIBRATION_SECONDS:g} "
                    f"(a longer calibration measures nothing more)", validate.describe(seconds))
    n = _CALIBRATION_SIZE
    generator = torch.Generator().manual_seed(0)   # its own generator: the notebook's random stream is untouched
    a = torch.randn(n, n, generator=generator)
    b = torch.randn(n, n, generator=generator)
    a @ b                                          # first call: allocation and thread start-up
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    times.sort()
    gflops = 2 * n**3 / max(times[len(times) // 2], 1e-9) / 1e9
    _state["slowdown"] = REFERENCE_GFLOPS / gflops
    return gflops


def slowdown() -> float:
    """How many times longer than the reference laptop this machine takes (calibrating once if needed)."""
    if "slowdown" not in _state:
        calibrate()
    return _state["slowdown"]


def _compare_with_reference(chosen: torch.device, advise: bool = True) -> str:
    if chosen.type != "cpu":
        return (f"this machine: runs on {chosen.type}; the times in the notebooks are the reference laptop's "
                f"(2 quiet CPU cores), so expect shorter runs")
    factor = slowdown()
    if 0.8 <= factor <= 1.25:
        speed = "about as fast as the reference laptop"
    elif factor > MOST_SLOWDOWN_SHOWN:
        speed = f"more than {MOST_SLOWDOWN_SHOWN:.0f}x slower than the reference laptop right now"
    elif factor > 1:
        speed = f"about {factor:.{0 if factor >= 10 else 1}f}x slower than the reference laptop"
    else:
        speed = f"about {1 / factor:.{0 if factor <= 0.1 else 1}f}x faster than the reference laptop"
    line = f"this machine: {speed} (2 quiet CPU cores), for which the notebooks' times are given"
    if advise and factor > CROWDED_SLOWDOWN and torch.get_num_threads() > 1:
        line += ("; other programs seem to be using the cores: if runs crawl, run "
                 "course_lib.runtime.set_threads(1) (or set COURSE_THREADS=1 before starting JupyterLab)")
    return line


def _seconds_text(seconds: float) -> str:
    if seconds < 100:
        return f"{seconds:.0f} s"
    return f"{seconds:.0f} s ({math.ceil(seconds / 60)} minutes)"


MOST_REFERENCE_SECONDS = 7 * 24 * 3600


def expect_time(reference_seconds: float, what: str) -> float:
    """Print how long ``what`` should take here, before a long run starts; return those seconds.

    ``reference_seconds`` is its time on the reference laptop; this machine's calibration scales it.
    """
    # bounded: a time past a week is no notebook cell's, and 1e308 seconds overflows the minutes shown
    validate.positive_float("reference_seconds", reference_seconds, finite=True)
    validate.expect(reference_seconds <= MOST_REFERENCE_SECONDS, "reference_seconds",
                    f"at most {MOST_REFERENCE_SECONDS:,} seconds (a week)", validate.describe(reference_seconds))
    if not isinstance(what, str) or not what.strip():
        raise TypeError(f"what: expected a short description such as 'training on Shakespeare', got {what!r}")
    factor = slowdown()
    here = reference_seconds * factor
    estimate = (f"more than {_seconds_text(reference_seconds * MOST_SLOWDOWN_SHOWN)}"
                if factor > MOST_SLOWDOWN_SHOWN else f"about {_seconds_text(here)}")
    print(f"{what}: about {_seconds_text(reference_seconds)} on the reference laptop; expected on this machine: "
          f"{estimate}")
    return here
