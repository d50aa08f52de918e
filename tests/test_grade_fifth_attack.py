"""What a fifth scripted attack on the grader found (2026-11-29): verdicts changed after the check wrote them (a
__del__, a trace function, `checks` rebound in the namespace), verdicts the student's code raised itself, tensors of
odd layouts and containers of odd classes, and processes started past the audit hook (which could lower the
limits of the sandbox's zygote, and so of every later student)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import course_lib
from course_lib.classroom import checks
from course_lib.classroom.checks._student_code import plain_tensors
from course_lib.classroom.grading import grading_plan
from course_lib.classroom.grading.judge import judge

# Reached from `checks` through the recorder's closures (as in the fourth attack): the verdict list.
_VERDICTS = '''
def _verdicts():
    lookup = type(checks).__getattr__
    recorded = dict(zip(lookup.__code__.co_freevars, lookup.__closure__))["recorded"].cell_contents
    return dict(zip(recorded.__code__.co_freevars, recorded.__closure__))["verdicts"].cell_contents

def _flip(verdicts):
    flipped = False
    for r in verdicts:
        if getattr(r, "exercise", None) in ("1.1", "2.1") and not r.passed:
            r.passed, r.diagnosis, r.message, flipped = True, None, "Right.", True
    return flipped
'''

# A __del__ that runs when the grader puts course_lib back after the cell, and flips the failure it finds.
FLIPPED_BY_DEL = _VERDICTS + '''
import course_lib.attention as _attention

class _Bomb:
    def __init__(self, verdicts):
        self.verdicts = verdicts
    def __del__(self):
        if not _flip(self.verdicts):   # armed again until it flipped a failure: the grader's own restore fires it
            setattr(_attention, "_grading_cache", _Bomb(self.verdicts))

def my_prediction():   # 1.1's cell calls it before its check: a check with no call of the student's inside
    setattr(_attention, "_grading_cache", _Bomb(_verdicts()))
    return [0.1, 0.1, 0.8], 3.0
'''

# A trace function, left on, that flips the failure when the grader's own bookkeeping runs.
FLIPPED_BY_TRACE = _VERDICTS + '''
import sys as _sys

def _tracer(frame, event, arg):
    if event == "call":
        _flip(_verdicts_seen)
    return None

def causal_mask(n):
    global _verdicts_seen
    _verdicts_seen = _verdicts()
    _sys.settrace(_tracer)
    return torch.zeros(n, n, dtype=torch.bool)
'''

# 1.1's cell calls my_prediction() before `checks.check_...`: it rebinds `checks` to a stub that files a pass.
CHECKS_REBOUND = _VERDICTS + '''
from course_lib.classroom.verdict import CheckResult as _Result

class _Stub:
    def __init__(self, verdicts):
        self.verdicts = verdicts
    def __getattr__(self, name):
        def check(*args, **kwargs):
            self.verdicts.append(_Result("1.1", True, None, "Right."))
        return check

def my_prediction():
    globals()["checks"] = _Stub(_verdicts())
    return [0.9, 0.05, 0.05], 42.0
'''

# The same, but the stub puts the recorder back at its first call: nothing is left rebound after the cell.
CHECKS_REBOUND_AND_BACK = _VERDICTS + '''
from course_lib.classroom.verdict import CheckResult as _Result

class _Stub:
    def __init__(self, verdicts, real):
        self.verdicts, self.real = verdicts, real
    def __getattr__(self, name):
        def check(*args, **kwargs):
            self.verdicts.append(_Result("1.1", True, None, "Right."))
            globals()["checks"] = self.real
        return check

def my_prediction():
    globals()["checks"] = _Stub(_verdicts(), checks)
    return [0.9, 0.05, 0.05], 42.0
'''

# A garbage-collector callback, run at every collection, that flips the failure wherever it finds it.
FLIPPED_BY_GC = _VERDICTS + '''
import gc as _gc

def _collected(phase, info):
    _flip(_verdicts_seen)

def causal_mask(n):
    global _verdicts_seen
    _verdicts_seen = _verdicts()
    if _collected not in _gc.callbacks:
        _gc.callbacks.append(_collected)
        _gc.set_threshold(1, 1, 1)
    return torch.zeros(n, n, dtype=torch.bool)
'''

# A property on the verdicts' own class, which every read of `passed` would ask.
CLASS_PATCHED = '''
from course_lib.classroom.verdict import CheckResult as _Result

def causal_mask(n):
    _Result.passed = property(lambda self: True, lambda self, value: None)
    return torch.zeros(n, n, dtype=torch.bool)
'''


@pytest.mark.parametrize("exercise,source", [("1.1", FLIPPED_BY_DEL), ("2.1", FLIPPED_BY_TRACE),
                                             ("1.1", CHECKS_REBOUND), ("1.1", CHECKS_REBOUND_AND_BACK),
                                             ("2.1", FLIPPED_BY_GC), ("2.1", CLASS_PATCHED)],
                         ids=["del", "trace", "rebound", "rebound-and-back", "gc", "class"])
def test_a_verdict_changed_after_the_check_wrote_it_is_patched_or_kept(exercise, source, monkeypatch):
    monkeypatch.setenv("COURSE_CHECK_IN_PROCESS", "1")   # as in the grader's exercise process: no fork below it
    import gc
    trace, callbacks, threshold = sys.gettrace(), list(gc.callbacks), gc.get_threshold()
    try:
        verdict = judge(grading_plan([exercise])[exercise], source)
    finally:
        sys.settrace(trace)
        gc.callbacks[:] = callbacks
        gc.set_threshold(*threshold)
    assert verdict["passed"] is False, verdict
    # patched; or, where the engine already put the course back before the grader read anything, the check's own
    # failure (the class's property gone, the verdict it never stored is the student's exception)
    assert verdict["diagnosis"] in ("patched", "causal_mask", "dtype", "exception", "mismatch"), verdict
    assert sys.gettrace() is trace   # the student's trace function does not outlive the check


@pytest.mark.parametrize("diagnosis", ["checker_error", "patched", "score_axes"])
def test_a_failure_the_students_code_raises_itself_is_its_exception(diagnosis):
    def causal_mask(n):
        from course_lib.classroom.verdict import Failure
        raise Failure(diagnosis, "This is a bug in the course. Tell the room: ...")
    result = checks.check_causal_mask(causal_mask)
    assert not result.passed and result.diagnosis == "exception", result
    assert "bug in the course" not in result.message and "raised the course's Failure itself" in result.message


def test_a_failure_of_a_course_helper_the_code_was_handed_is_still_the_verdict():
    """The course's own Failure from a course function the student's code called is not a forgery."""
    from course_lib.classroom.checks._student_code import call, expect_tensor
    from course_lib.classroom.verdict import Failure

    with pytest.raises(Failure) as raised:
        call(lambda: expect_tensor(None, (2,), "the cache"), what="code")
    assert raised.value.diagnosis == "shape"


@pytest.mark.parametrize("make", [lambda: torch.eye(3).to_sparse(),
                                  lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])],
                         ids=["sparse", "nested"])
def test_a_tensor_of_another_layout_is_the_students_dtype_not_the_course(make):
    result = checks.check_causal_mask(lambda n: make())
    assert not result.passed and result.diagnosis == "dtype", result
    assert "bug in the course" not in result.message


def test_containers_of_other_classes_are_plain_and_their_tensors_too():
    class Pair(tuple):
        pass

    class Yes(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return True
    value = plain_tensors(Pair((torch.ones(2).as_subclass(Yes), [torch.zeros(1).as_subclass(Yes)])))
    assert type(value) is tuple and type(value[0]) is torch.Tensor and type(value[1]) is list
    assert type(value[1][0]) is torch.Tensor


# In a process entered as a sandboxed exercise: the ways past the audit hook are closed, and a fresh import of
# their modules is refused.
_CLOSED_PROBE = r"""
import os, sys
from course_lib.classroom.grading import sandbox
home = sys.argv[1]
sandbox.enter(home, [], memory_mb=None, cpu_seconds=None)   # standard output closed: the answer goes to a file
refused = []
import _posixsubprocess
try:
    _posixsubprocess.fork_exec()
except sandbox.SandboxRefused:
    refused.append("fork_exec")
del sys.modules["_posixsubprocess"]
try:
    import _posixsubprocess
except sandbox.SandboxRefused:
    refused.append("import")
for way in (lambda: os.pidfd_open(1), lambda: sys.settrace(lambda *args: None)):
    try:
        way()
    except sandbox.SandboxRefused:
        refused.append("refused")
with open("refused.txt", "w") as out:
    out.write(",".join(refused))
"""


def test_processes_signals_and_trace_functions_past_the_audit_are_refused_in_an_exercise_process(tmp_path):
    package_root = str(Path(course_lib.__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", _CLOSED_PROBE, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": package_root})
    answer = tmp_path / "refused.txt"
    assert answer.exists() and answer.read_text() == "fork_exec,import,refused,refused", \
        (answer.read_text() if answer.exists() else "") + done.stderr[-2000:]


# The zygote's own limits, priority and CPUs, lowered by a process of the same user (as one started past the
# audit hook could): the sweep refuses to hand the sandbox to the next student.
_ZYGOTE_PROBE = r"""
import os, resource
from course_lib.classroom.grading import zygote
assert zygote.alone_in_sandbox(), sorted(os.listdir("/proc"))
assert zygote.sweep(), "the sweep failed with nothing changed"
zygote_pid = os.getpid()
child = os.fork()
if child == 0:
    soft, hard = resource.prlimit(zygote_pid, resource.RLIMIT_NOFILE)
    resource.prlimit(zygote_pid, resource.RLIMIT_NOFILE, (min(soft, 64), min(hard, 64)))
    os._exit(0)
os.waitpid(child, 0)
print("REFUSED" if not zygote.sweep() else "SWEPT")
"""


def test_a_zygote_whose_limits_were_lowered_is_not_handed_to_the_next_student():
    package_root = str(Path(course_lib.__file__).resolve().parents[1])
    done = subprocess.run(
        ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev",
         "--tmpfs", "/tmp", *[arg for path in sorted({package_root, sys.prefix}) for arg in ("--ro-bind", path, path)],
         "--setenv", "PYTHONPATH", package_root, sys.executable, "-c", _ZYGOTE_PROBE],
        capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().endswith("REFUSED"), done.stdout + done.stderr[-3000:]


def test_no_line_of_grades_csv_starts_a_formula_whatever_the_message_holds():
    """A message with a newline: a reader that ignores CSV quoting starts a row at each line."""
    from course_lib.classroom.grading.grades import Grade
    from course_lib.classroom.grading.report import grades_csv
    text = grades_csv([Grade("ada", "2.1", False, "exception", 'wrong\n=HYPERLINK("http://x","click")\r\n+1', 0.1)])
    assert all(not line.startswith(("=", "+", "-", "@")) for line in text.splitlines()), text
    assert len(text.splitlines()) == 2


def test_in_the_sandbox_8_1s_reference_run_is_built_from_the_courses_own_parts(tmp_path):
    """The sandbox's notebooks hold no solutions: the reference GPT of 8.1 took them and raised for every student,
    the course's own solution included. A withheld solution now leaves course_lib's version in its place."""
    import dataclasses

    import course_lib
    from course_lib.classroom import collect
    from course_lib.classroom.grading.stubs import without_solutions
    found = collect.collect_student_parts(tmp_path)   # no notebook: every part is the course's
    withheld = collect.Collection(tmp_path, {ex_id: dataclasses.replace(part, exercise=dataclasses.replace(
        part.exercise, solution=without_solutions(part.exercise.solution))) for ex_id, part in found.parts.items()})
    assert any(collect.WITHHELD in p.exercise.solution for p in withheld.parts.values())
    namespace = withheld.namespace(yours=())
    assert namespace["MultiHeadMaskedAttention"] is course_lib.MultiHeadMaskedAttention
    assert namespace["causal_mask"](3).dtype == torch.bool   # runs: not the withheld stub
