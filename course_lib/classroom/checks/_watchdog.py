"""A time limit no student code can swallow: the check runs in a forked child, and the kernel waits.

An alarm raised inside the student's code is an exception like any other: a bare ``except:`` in a loop
swallows it, and ``signal.signal(signal.SIGALRM, signal.SIG_IGN)`` cancels it. So where the platform can
fork, the whole check runs in a child process, a copy of the kernel made in a few milliseconds: the
student's code, the references and the probes see exactly the kernel's objects, and the kernel itself
(the parent) only waits for the verdict on a pipe. When the time is up the parent kills the child; what
the child's code caught, ignored or broke does not matter, and nothing it changed (globals, RNG, modules)
reaches the kernel. The child still runs the usual in-process alarm, so a plain endless loop gets the
ordinary "timeout" verdict a little sooner than the kill.

Not forked, and judged in the kernel under the alarm alone (see ``_harness``): where there is no
``os.fork`` (Windows), on macOS (Apple's frameworks are not safe to use after a fork), once CUDA is
initialised (CUDA cannot be used in a forked child), inside a child already (a check nested in a check),
inside the grader's sandbox (it refuses to fork: the grader's worker already runs each exercise in a
process it kills), and when ``COURSE_CHECK_IN_PROCESS=1``.

Ctrl-C (the notebook's stop button) interrupts the parent's wait: the child is killed and
``KeyboardInterrupt`` goes on as usual. A child that dies without a verdict (``os._exit``, a signal, memory)
is a verdict of its own, ``crashed``.
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from ..verdict import CheckResult

GRACE_S = 2.0      # after the in-child alarm should have rung, before the kill
_in_child = False  # True in a forked child: a check nested in a check runs in place


def available() -> bool:
    """Whether checks can run in a forked child here (see the module's docstring for where not)."""
    if _in_child or not hasattr(os, "fork") or sys.platform == "darwin":
        return False
    if os.environ.get("COURSE_CHECK_IN_PROCESS") == "1":
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_initialized())


def _portable(result: CheckResult) -> bytes:
    """The verdict as bytes for the pipe; a detail that cannot be pickled travels as its repr."""
    try:
        return pickle.dumps(("result", result))
    except Exception:  # a student's class defined in a function, a lambda, an open file in the details
        pass
    details: dict[str, Any] = {}
    for key, value in result.details.items():
        try:
            pickle.dumps(value)
            details[key] = value
        except Exception:
            details[key] = repr(value)
    portable = CheckResult(result.exercise, result.passed, result.diagnosis, result.message, details)
    return pickle.dumps(("result", portable))


def _child(judge: Callable[[], CheckResult], write_end: int) -> None:
    """In the forked child: judge, send the verdict, leave at once (no atexit, no kernel machinery)."""
    global _in_child
    _in_child = True
    code = 0
    try:
        try:
            os.setpgid(0, 0)   # its own group: the parent's kill reaches whatever it started
        except OSError:
            pass
        torch.set_num_threads(1)   # a thread pool copied by fork is not usable; one thread needs none
        # and stays at one: code that asks for more threads here would wake the copied pool and hang
        # (seen: set_num_threads(3) in a student's function, then a matmul, never returned)
        torch.set_num_threads = lambda threads: None
        try:
            payload = _portable(judge())
        except KeyboardInterrupt:
            payload = pickle.dumps(("interrupted", None))
        except BaseException as exc:  # the harness lets nothing else out; should it, say what
            payload = pickle.dumps(("error", f"{type(exc).__name__}: {exc}"))
        view = memoryview(payload)
        while view:
            view = view[os.write(write_end, view):]
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()   # what the student's code printed
            except Exception:
                pass
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _kill(pid: int) -> None:
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass


def run(judge: Callable[[], CheckResult], exercise: str, limit: float,
        timed_out: Callable[[], CheckResult]) -> CheckResult | None:
    """Run ``judge`` in a forked child and return its verdict; None when this process may not fork.

    ``limit`` seconds (0: none) plus a grace, then the child is killed and ``timed_out()`` is the verdict.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()   # or the child would print the kernel's pending output a second time
        except Exception:
            pass
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
    except (OSError, RuntimeError):   # the grader's sandbox refuses (its worker already isolates), or no memory
        os.close(read_end)
        os.close(write_end)
        return None
    if pid == 0:
        os.close(read_end)
        _child(judge, write_end)   # never returns
    os.close(write_end)
    deadline = time.monotonic() + limit + GRACE_S if limit > 0 else None
    chunks: list[bytes] = []
    late = False
    try:
        while True:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                late = True
                break
            ready, _, _ = select.select([read_end], [], [], wait)
            if not ready:
                continue
            data = os.read(read_end, 1 << 16)
            if not data:
                break
            chunks.append(data)
            if _complete(chunks):   # whole: a process the student's code left holding the pipe cannot stall it
                break
    except BaseException:   # Ctrl-C in the kernel: stop the child, then interrupt as usual
        _kill(pid)
        _reap(pid)
        os.close(read_end)
        raise
    if late:
        _kill(pid)
    status = _reap(pid)
    _kill(pid)   # anything the child left in its group
    os.close(read_end)
    if late:
        return timed_out()
    try:
        kind, value = pickle.loads(b"".join(chunks)) if chunks else (None, None)
    except Exception:
        kind, value = None, None
    if kind == "result" and isinstance(value, CheckResult):
        return value
    if kind == "interrupted":
        raise KeyboardInterrupt
    if kind == "error":
        return CheckResult(exercise, False, "checker_error",
                           f"The checker for exercise {exercise} failed ({value}). This is a bug in the course, "
                           f"not necessarily in your code: please report it with this message.")
    return CheckResult(exercise, False, "crashed",
                       f"The process running your code {_describe(status)} before the check finished: look for "
                       f"os._exit, os.kill or signal calls, or memory use far beyond what the exercise needs. "
                       f"Your notebook's kernel is unharmed.")


def _complete(chunks: list[bytes]) -> bool:
    try:
        pickle.loads(b"".join(chunks))
        return True
    except Exception:
        return False


def _reap(pid: int) -> int | None:
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return None


def _describe(status: int | None) -> str:
    if status is not None and os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            return f"was killed by {signal.Signals(number).name}"
        except ValueError:
            return f"was killed by signal {number}"
    if status is not None and os.WIFEXITED(status):
        return f"exited with status {os.WEXITSTATUS(status)}"
    return "ended"
