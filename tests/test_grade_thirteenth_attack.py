"""A thirteenth and a fourteenth attack on the grader (2026-11-30): code a submission leaves to run unasked.

A default argument runs when its ``def`` runs, so a definition could install a garbage collector's callback (with a
threshold of 1, a collection at nearly every allocation), a profile function or a thread, each reaching the
grader's list of verdicts through the closures of ``checks`` and putting a pass where the checker had failed, in
the moment between the checker's return and the grader's record. The grader compared these with what it read
after the definition had run, so they counted as given. They are read now before any code of the student's, again
as soon as a checker returns, and after the check cell; any difference is the verdict ``patched``.

A fourteenth attack broke that: an audit hook (the sandbox now refuses them), a profiler whose ``__eq__`` says
equal (compared by identity now), ``threading.gettrace`` rebound (the grader's getters are its own, taken at
import), and a gc callback that removed itself after rewriting the checker's result (the collector is put back
after every call into the student's code). tqdm's monitor thread made honest code ``patched``: it is off.

A fifteenth attack wrote a verdict into the worker's pipe with the token it found in a frame's locals, and swapped
the verdict in the list from a signal handler rung by a timer: frames and gc.get_objects are refused to the
student's code (and to inspect and traceback when it asks), and signal handlers and timers are hooks too.

An honest definition written as ``name = lambda ...`` was "missing"; it is a definition.
"""
from __future__ import annotations

import platform
import sys

import pytest
from sandboxed_judge import judged_in_sandbox

from course_lib.classroom import notebook_reader

LINUX = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")

# Finds the grader's verdict list from `checks` and turns a failing 2.1 into a pass.
_FORGE = '''
from course_lib.classroom.verdict import CheckResult as _CR
_G = globals()
def _forge(*_):
    try:
        look = type(_G["checks"]).__dict__["__getattr__"]
        for cell in look.__closure__ or ():
            for inner in getattr(cell.cell_contents, "__closure__", None) or ():
                found = inner.cell_contents
                if type(found) is list:
                    for i, r in enumerate(found):
                        if type(r) is _CR and r.exercise == "2.1" and not r.passed:
                            found[i] = _CR("2.1", True, None, "Right.")
    except Exception:
        pass
'''
_WRONG = "    return torch.zeros(n, n, dtype=torch.bool)   # wrong: everything hidden\n"
_AT_DEFINITION = {
    "gc-callback": "import gc\ndef _install():\n    gc.callbacks.append(_forge)\n    gc.set_threshold(1, 100000, 100000)\n",
    "profiler": "import sys\ndef _install():\n    sys.setprofile(lambda frame, event, arg: _forge())\n",
    "thread": ("import sys, threading\ndef _loop():\n    while True:\n        _forge()\n"
               "def _install():\n    sys.setswitchinterval(1e-6)\n    threading.Thread(target=_loop, daemon=True).start()\n"),
}
# Rewrites the checker's own result, wherever a frame of the grader's holds it.
_REWRITE = """
import sys
from course_lib.classroom.verdict import CheckResult as _CR
def _rewrite(result):
    if type(result) is _CR and result.exercise == "2.1" and not result.passed:
        result.passed, result.diagnosis, result.message = True, None, "Right."
def _rewrite_above(frame):
    while frame is not None:
        _rewrite(frame.f_locals.get("result"))
        frame = frame.f_back
"""
_AT_DEFINITION.update({
    # an audit hook sees sys._getframe's frame, and can never be removed
    "audit-hook": "def _install():\n    sys.addaudithook(lambda event, args: event == 'sys._getframe' and args "
                  "and _rewrite_above(args[0]))\n",
    # a profiler equal to anything: a comparison with == would believe it
    "profiler-equal-to-anything": ("class _Equal:\n    def __eq__(self, other):\n        return True\n"
                                   "    def __ne__(self, other):\n        return False\n    __hash__ = object.__hash__\n"
                                   "    def __call__(self, frame, event, arg):\n        _rewrite_above(frame)\n"
                                   "def _install():\n    sys.setprofile(_Equal())\n"),
    # the grader's detector itself, rebound in the module it is read from
    "threading-gettrace-rebound": ("import threading\n_real = threading.gettrace\ndef _lying():\n"
                                   "    _rewrite_above(sys._getframe(1))\n    return _real()\n"
                                   "def _install():\n    threading.gettrace = _lying\n"),
})
# installed by the student's function itself, while the checker calls it: a callback that removes itself
_DURING_CHECK = {
    "gc-callback-removing-itself": ("import gc\ndef _once(phase, info):\n    _rewrite_above(sys._getframe(1))\n"
                                    "def _install():\n    if _once not in gc.callbacks:\n"
                                    "        gc.callbacks.append(_once)\n        gc.set_threshold(1, 1000000, 1000000)\n"),
}
ATTACKS = {
    **{name: _FORGE + _REWRITE + code + "def causal_mask(n, _i=_install()):\n" + _WRONG
       for name, code in _AT_DEFINITION.items()},
    **{name: _FORGE + _REWRITE + code + "def causal_mask(n):\n    _install()\n" + _WRONG
       for name, code in _DURING_CHECK.items()},
}
# a fifteenth attack: a signal handler that a repeating timer rings, swapping the verdict in the list
_AT_DEFINITION["signal-timer"] = ("import signal\ndef _install():\n    signal.signal(signal.SIGALRM, lambda *_: _forge())\n"
                                  "    signal.setitimer(signal.ITIMER_REAL, 2e-4, 2e-4)\n")
ATTACKS["signal-timer"] = _FORGE + _REWRITE + _AT_DEFINITION["signal-timer"] + "def causal_mask(n, _i=_install()):\n" + _WRONG
# and frames, the way to the grader's records (the worker's pipe and its token among them): refused to the student
INTROSPECTION = {
    "sys._getframe": "import sys\ndef causal_mask(n, _f=sys._getframe()):\n" + _WRONG,
    "inspect.currentframe": "import inspect\ndef causal_mask(n):\n    inspect.currentframe().f_back\n" + _WRONG,
    "a traceback's frame": ("def causal_mask(n):\n    try:\n        raise ValueError\n    except ValueError as e:\n"
                            "        e.__traceback__.tb_frame.f_back\n" + _WRONG),
    "gc.get_objects": "import gc\ndef causal_mask(n, _o=gc.get_objects()):\n" + _WRONG,
}
# the thread last: nothing stops a thread once started, and it goes on forging in this process
ORDER = ["gc-callback", "profiler", "audit-hook", "profiler-equal-to-anything", "threading-gettrace-rebound",
         "gc-callback-removing-itself", "signal-timer", "thread"]
# honest code that starts a library's thread: tqdm's monitor is off while grading
PROGRESS_BAR = ("from tqdm import tqdm\n\ndef causal_mask(n, device=None):\n"
                "    rows = [torch.arange(n, device=device) <= i for i in tqdm(range(n))]\n"
                "    return torch.stack(rows) if n else torch.ones(0, 0, dtype=torch.bool, device=device)\n")

@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="the sandbox as a forked exercise's process enters it")
def test_code_left_to_run_unasked_is_patched_never_a_forged_pass(tmp_path):
    assert sorted(ORDER) == sorted(ATTACKS)
    sources = [PROGRESS_BAR, *INTROSPECTION.values()] + [ATTACKS[name] for name in ORDER]
    honest, *verdicts = judged_in_sandbox(tmp_path, "2.1", sources)
    assert honest["passed"], honest
    for name, verdict in zip(INTROSPECTION, verdicts):
        assert (verdict["passed"], verdict["diagnosis"]) == (False, "exception"), (name, verdict)
        assert "sandbox does not allow frames" in verdict["message"], (name, verdict)
    verdicts = verdicts[len(INTROSPECTION):]
    for name, verdict in zip(ORDER, verdicts):
        # refused where it was set (the audit hook: never added, so the wrong mask fails as itself; a profile
        # function: refused to the student's code since the sixteenth attack) or patched
        assert not verdict["passed"] and verdict["diagnosis"] in ("patched", "causal_mask", "exception"), (name, verdict)
        expected = {"profiler": "exception", "profiler-equal-to-anything": "exception",   # refused since the 16th
                    "signal-timer": "exception"}.get(name, "patched")                     # and the 18th attacks
        assert verdict["diagnosis"] == expected or name in ("audit-hook", "threading-gettrace-rebound"), (name, verdict)


def _cells(source: str) -> list:
    import nbformat
    return [nbformat.v4.new_code_cell(source, id="exercise-2-1")]


def test_a_lambda_assigned_to_the_name_is_its_definition():
    found = notebook_reader.student_definition(
        _cells("import torch\n\ncausal_mask = lambda n, device=None: torch.ones(n, n, dtype=torch.bool).tril()\n"),
        "causal_mask", "exercise-2-1", set())
    assert found.problem is None and "causal_mask = lambda" in found.source and "import torch" in found.source


def test_a_definition_inside_an_if_is_said_to_be_missing_at_the_top_level():
    found = notebook_reader.student_definition(
        _cells("if True:\n    def causal_mask(n):\n        return None\n"), "causal_mask", "exercise-2-1", set())
    assert found.problem == "not_defined"
    assert "outside any if" in notebook_reader.TOP_LEVEL
