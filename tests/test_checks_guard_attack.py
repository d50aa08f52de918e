"""The reference guard and the check's restore under a seventh attack (2026-11-29): code left for the restore to
run, threads started with the profiler off, a check nested in a check, a restore made to raise. None makes the
course's answer pass as the student's, a wrong answer pass, or a checker raise."""
from __future__ import annotations

import _thread
import gc
import logging
import sys
import threading

import pytest
import torch
from guard_watcher import raise_once_in_the_watcher

import course_lib.attention as attention
from course_lib.classroom import checks


def test_code_left_for_the_restore_cannot_change_the_verdict(check_process):
    """A value whose != flips the verdict it finds in memory: the restore compared it, after the verdict was made."""
    class Level(int):
        def __ne__(self, other):
            for found in gc.get_objects():
                if type(found).__name__ == "CheckResult" and getattr(found, "exercise", None) == "2.1":
                    found.passed, found.diagnosis = True, None
            return int.__ne__(self, other)

    def causal_mask(n):
        logging.Logger.manager.disable = Level(0)
        return torch.zeros(n, n, dtype=torch.bool)   # wrong: every key hidden
    manager, disabled = logging.Logger.manager, logging.Logger.manager.disable
    try:
        result = checks.check_causal_mask(causal_mask, graded=False)
        assert (result.passed, result.diagnosis) == (False, "causal_mask"), result
        assert type(logging.Logger.manager.disable) is int
    finally:
        logging.Logger.manager, manager.disable = manager, disabled


def _in_a_thread(start):
    def causal_mask(n):
        done, finished = [], _thread.allocate_lock()
        finished.acquire()

        def job():
            try:
                done.append(attention.causal_mask(n))
            finally:   # the guard raises in the thread when it sees the course's answer called
                finished.release()
        start(job)
        finished.acquire()
        return done[0] if done else torch.ones(n, n, dtype=torch.bool).tril()
    return causal_mask


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the guard's, in the thread
@pytest.mark.parametrize("start", [
    lambda job: (threading.setprofile(None), threading.Thread(target=job).start()),
    lambda job: _thread.start_new_thread(job, ()),
], ids=["threading's profiler switched off", "a thread of _thread"])
def test_the_courses_answer_in_a_thread_is_seen(start, check_process):
    hook = threading.getprofile()
    try:
        result = checks.check_causal_mask(_in_a_thread(start), graded=False)
    finally:
        threading.setprofile(hook)
    assert (result.passed, result.diagnosis) == (False, "calls_reference"), result


def test_a_check_nested_in_a_check_cannot_cover_for_a_profiler_switched_off(monkeypatch):
    """Ctrl-C landing in the guard's hook switches the profiler off (Python unsets a hook that raises); code that
    catches it and calls the course's answer inside a check of another exercise was covered for: the inner check's
    guard put back, when it ended, the profiler it had found."""
    monkeypatch.setenv("COURSE_CHECK_IN_PROCESS", "1")   # the watcher of this very process
    stash = {}
    stash["landed"] = raise_once_in_the_watcher(monkeypatch, lambda: knock.__code__, KeyboardInterrupt)

    def knock():
        return None

    def inner(logits, targets):
        try:
            knock()
        except KeyboardInterrupt:
            pass
        stash["mask"] = attention.causal_mask(5)   # unwatched now
        return torch.zeros(())

    def causal_mask(n):
        checks.check_lm_loss(inner, graded=False)
        return torch.ones(n, n, dtype=torch.bool).tril() if n != 5 else stash["mask"]
    result = checks.check_causal_mask(causal_mask, graded=False)
    assert stash["landed"] and not result.passed and result.diagnosis in ("patched", "calls_reference"), result


def test_a_restore_made_to_raise_leaves_a_verdict_and_the_kernel_as_it_was(check_process):
    mkldnn = torch.backends.mkldnn

    class Raising:
        @property
        def enabled(self):
            raise KeyError("planted")

    def causal_mask(n):
        torch.backends.mkldnn = Raising()
        return torch.ones(n, n, dtype=torch.bool).tril()   # right
    try:
        assert checks.check_causal_mask(causal_mask, graded=False).passed
        assert torch.backends.mkldnn is mkldnn
        assert checks.check_causal_mask(lambda n: torch.ones(n, n, dtype=torch.bool).tril(), graded=False).passed
    finally:
        torch.backends.mkldnn = mkldnn


# ---------------------------------------------------------------- an eighth attack, on the fixes above

def test_right_code_that_uses_a_thread_passes(check_process):
    def causal_mask(n):
        out = []
        worker = threading.Thread(target=lambda: out.append(torch.ones(n, n, dtype=torch.bool).tril()))
        worker.start()
        worker.join()
        return out[0]
    assert checks.check_causal_mask(causal_mask, graded=False).passed


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_courses_answer_from_a_watched_worker_thread_is_seen(check_process):
    """In a pool's thread no frame of the student's is on the stack: a call from any thread but the checking one
    is the student's doing."""
    from concurrent.futures import ThreadPoolExecutor

    def causal_mask(n):
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(attention.causal_mask, n).result()
    result = checks.check_causal_mask(causal_mask, graded=False)
    assert (result.passed, result.diagnosis) == (False, "calls_reference"), result


def test_an_environment_replaced_by_the_students_code_is_put_back_unasked(check_process):
    import os
    environ = os.environ

    class Environment(dict):
        def get(self, key, default=None):   # asked after the verdict existed: it rewrote it
            for found in gc.get_objects():
                if type(found).__name__ == "CheckResult" and getattr(found, "exercise", None) == "2.1":
                    found.passed = True
            return dict.get(self, key, default)

    def causal_mask(n):
        os.environ = Environment(os.environ)   # noqa: B003 - the attack
        return torch.zeros(n, n, dtype=torch.bool)   # wrong
    try:
        result = checks.check_causal_mask(causal_mask, graded=False)
        assert (result.passed, result.diagnosis) == (False, "causal_mask"), result
        assert os.environ is environ
    finally:
        os.environ = environ   # noqa: B003 - the kernel's own object back


def test_a_numpy_setter_that_raises_leaves_a_verdict(check_process, monkeypatch):
    import numpy

    def causal_mask(n):
        numpy.random.set_state = lambda state: 1 / 0
        return torch.ones(n, n, dtype=torch.bool).tril()   # right
    monkeypatch.setattr(numpy.random, "set_state", numpy.random.set_state)   # put back after the test
    assert checks.check_causal_mask(causal_mask, graded=False).passed
    assert checks.check_causal_mask(lambda n: torch.ones(n, n, dtype=torch.bool).tril(), graded=False).passed


def test_the_engines_own_profiler_setter_is_not_the_students(check_process):
    from course_lib.classroom.checks.engine import run

    def causal_mask(n):
        hook = sys.getprofile()
        run._own_setprofile(None)
        mask = attention.causal_mask(n)
        run._own_setprofile(hook)
        return mask
    result = checks.check_causal_mask(causal_mask, graded=False)
    assert not result.passed and result.diagnosis in ("patched", "exception", "calls_reference"), result
