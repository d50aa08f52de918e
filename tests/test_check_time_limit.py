"""A time limit no student code can swallow, and whatever the student's code raises is the student's verdict.

Every hostile attempt runs against several checkers: a bare ``except:`` in a loop, ``except BaseException``,
the alarm ignored, cancelled or blocked, a BaseException subclass, GeneratorExit, os._exit. Each must end in
a verdict within the limit (plus the grace before the kill), and the kernel must be as it was.
"""
from __future__ import annotations

import os
import random
import signal
import sys
import time

import pytest
import torch

import course_lib.attention as attention
from course_lib.classroom import checks
from course_lib.classroom.checks.engine import run

pytestmark = pytest.mark.skipif(not run.can_fork(), reason="checks run in a forked child only where the "
                                                                    "platform forks (Linux); see engine.run")

LIMIT_S = 0.2   # short, so that 30 hostile loops cost seconds, not a minute: the verdict does not depend on it
FULL_LIMIT_S = run.TIME_LIMIT_S   # what a notebook's checks get


@pytest.fixture
def short_limit(monkeypatch):
    monkeypatch.setattr(run, "TIME_LIMIT_S", LIMIT_S)
    monkeypatch.setattr(run, "GRACE_S", 0.4)
    return monkeypatch


# Function checkers, each called with a hostile function that takes whatever it is given.
CHECKERS = ["check_causal_mask", "check_toy_attention", "check_scaled_dot_product_attention",
            "check_online_softmax", "check_flash_attention"]


def _bare_except_loop(*args, **kwargs):
    while True:
        try:
            time.sleep(0.01)
        except:  # noqa: E722 - the attack: a bare except swallows any exception raised by an alarm
            pass


def _base_exception_loop(*args, **kwargs):
    while True:
        try:
            while True:
                pass
        except BaseException:
            continue


def _ignores_the_alarm(*args, **kwargs):
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    while True:
        pass


def _cancels_the_alarm(*args, **kwargs):
    signal.setitimer(signal.ITIMER_REAL, 0)
    while True:
        pass


def _blocks_the_alarm(*args, **kwargs):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    while True:
        pass


def _swallows_in_finally(*args, **kwargs):
    while True:
        try:
            pass
        finally:
            continue   # a `continue` in `finally` discards whatever was raised  # noqa: B012


HANGS = [_bare_except_loop, _base_exception_loop, _ignores_the_alarm, _cancels_the_alarm, _blocks_the_alarm,
         _swallows_in_finally]


def _kernel():
    return (torch.get_rng_state().clone(), random.getstate(), torch.is_grad_enabled(), torch.get_num_threads(),
            signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)[0],
            signal.pthread_sigmask(signal.SIG_BLOCK, set()), dict(vars(attention)))


@pytest.mark.parametrize("hang", HANGS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("name", CHECKERS)
def test_no_student_code_outlasts_the_time_limit(name, hang, short_limit):
    before = _kernel()
    start = time.monotonic()
    result = getattr(checks, name)(hang)
    took = time.monotonic() - start
    assert result.diagnosis == "timeout" and not result.passed, result
    assert f"{LIMIT_S:g} seconds" in result.message
    assert took < 30, took   # not a timing claim: a bound that a check that never returns would break
    after = _kernel()
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]
    # the kernel still checks, under a notebook's own limit: half a second is too short for a whole check
    # on a loaded machine
    short_limit.setattr(run, "TIME_LIMIT_S", FULL_LIMIT_S)
    assert checks.check_causal_mask(attention.causal_mask).passed


class Escapes(BaseException):
    """Not an Exception: `except Exception` in a checker would let it through."""


def _raises(exc):
    def student(*args, **kwargs):
        raise exc
    return student


@pytest.mark.parametrize("exc, shown", [(Escapes("out"), "Escapes"), (GeneratorExit(), "GeneratorExit"),
                                        (type("Exit", (SystemExit,), {})(2), "sys.exit(2)")])
@pytest.mark.parametrize("name", CHECKERS)
def test_whatever_the_student_raises_is_the_students_verdict(name, exc, shown):
    result = getattr(checks, name)(_raises(exc))
    assert not result.passed and result.diagnosis == "exception", result
    assert shown in result.message


@pytest.mark.parametrize("name", CHECKERS)
def test_a_student_base_exception_is_a_verdict_in_process_too(name, monkeypatch):
    monkeypatch.setenv("COURSE_CHECK_IN_PROCESS", "1")
    assert not run.can_fork()
    result = getattr(checks, name)(_raises(Escapes("out")))
    assert result.diagnosis == "exception" and "Escapes" in result.message, result


class _HangsInInit(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()
        while True:
            try:
                pass
            except:  # noqa: E722
                pass


def test_a_class_checker_is_stopped_too(short_limit):
    result = checks.check_masked_attention(_HangsInInit)
    assert result.diagnosis == "timeout", result


@pytest.mark.parametrize("name", CHECKERS[:2])
def test_a_child_that_dies_is_a_crashed_verdict_and_the_kernel_lives(name):
    def dies(*args, **kwargs):
        os._exit(3)
    result = getattr(checks, name)(dies)
    assert result.diagnosis == "crashed" and "status 3" in result.message, result
    assert os.getpid() and checks.check_causal_mask(attention.causal_mask).passed


def test_ctrl_c_from_the_students_code_still_interrupts():
    with pytest.raises(KeyboardInterrupt):
        checks.check_causal_mask(_raises(KeyboardInterrupt()))


def test_the_stop_button_interrupts_the_wait_and_leaves_no_child(short_limit):
    # the kernel receives SIGINT while the child loops: the wait ends with KeyboardInterrupt, the child is gone.
    # A kernel's SIGINT raises KeyboardInterrupt; a test process may have inherited another disposition (SIG_IGN
    # from a library's worker set-up), so the test sets the kernel's own.
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGALRM, lambda *a: os.kill(os.getpid(), signal.SIGINT))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            checks.check_causal_mask(_ignores_the_alarm)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, interrupt)
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)   # no child left to reap


def test_what_the_students_code_changes_never_reaches_the_kernel():
    def meddles(n):
        attention.SOMETHING_NEW = 1
        sys.modules["course_lib_meddled"] = object()
        torch.manual_seed(123)
        return torch.ones(n, n, dtype=torch.bool).tril()
    before = torch.get_rng_state().clone()
    assert checks.check_causal_mask(meddles).passed
    assert not hasattr(attention, "SOMETHING_NEW") and "course_lib_meddled" not in sys.modules
    assert torch.equal(torch.get_rng_state(), before)


def test_a_verdict_with_details_that_cannot_be_pickled_still_comes_back():
    def local_mask(n):
        return torch.ones(n, n, dtype=torch.bool).triu()   # wrong: a counter-example rides on the verdict
    result = checks.check_causal_mask(local_mask)
    assert not result.passed and result.diagnosis == "causal_mask", result


def _asks_for_threads(n):
    torch.set_num_threads(3)
    x = torch.randn(256, 256)
    (x @ x).sum()
    torch.randn(1_000_000).exp().sum()
    return torch.ones(n, n, dtype=torch.bool).tril()


def test_code_that_asks_for_more_threads_does_not_hang_the_forked_check():
    """A thread pool copied by fork hangs at its next parallel op: the child keeps one thread, whatever
    the student's code asks for, and the kernel keeps its own count."""
    torch.set_num_threads(2)
    x = torch.randn(256, 256)
    (x @ x).sum()   # the kernel's pool has run, as it has in any notebook
    result = checks.check_causal_mask(_asks_for_threads)
    assert result.passed, result
    assert torch.get_num_threads() == 2


def test_a_failed_verdict_of_the_child_is_not_judged_again_in_the_kernel():
    calls = []

    def wrong(n):
        calls.append(n)   # in the forked child: the kernel's list never sees it
        return torch.ones(n, n, dtype=torch.bool).triu()
    result = checks.check_causal_mask(wrong)
    assert not result.passed and result.diagnosis == "causal_mask", result
    assert calls == []


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), "60"])
def test_the_graders_time_limit_names_its_argument(seconds):
    with pytest.raises((TypeError, ValueError), match="seconds: expected"):
        run.set_time_limit(seconds)
