"""A thirteenth attack on the grader (2026-11-30): code a submission leaves to run unasked.

A default argument runs when its ``def`` runs, so a definition could install a garbage collector's callback (with a
threshold of 1, a collection at nearly every allocation), a profile function or a thread, each reaching the
grader's list of verdicts through the closures of ``checks`` and putting a pass where the checker had failed, in
the moment between the checker's return and the grader's record. The grader compared these with what it read
after the definition had run, so they counted as given. They are read now before any code of the student's, again
as soon as a checker returns, and after the check cell; any difference is the verdict ``patched``.

An honest definition written as ``name = lambda ...`` was "missing"; it is a definition.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

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
# the same installed by the student's function itself, while the checker calls it
_DURING_CHECK = {
    "gc-callback-in-a-call": "import gc\ndef _install():\n    if _forge not in gc.callbacks:\n"
                             "        gc.callbacks.append(_forge)\n        gc.set_threshold(1, 100000, 100000)\n",
}
ATTACKS = {
    **{name: _FORGE + code + "def causal_mask(n, _i=_install()):\n" + _WRONG for name, code in _AT_DEFINITION.items()},
    **{name: _FORGE + code + "def causal_mask(n):\n    _install()\n" + _WRONG for name, code in _DURING_CHECK.items()},
}
# the thread last: nothing stops a thread once started, and it goes on forging in this process
ORDER = ["gc-callback", "profiler", "gc-callback-in-a-call", "thread"]


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="the sandbox as a forked exercise's process enters it")
def test_code_left_to_run_unasked_is_patched_never_a_forged_pass(tmp_path):
    assert sorted(ORDER) == sorted(ATTACKS)
    script = ("import json, os, sys\n"
              "from course_lib.classroom.grading import grading_plan, sandbox\n"
              "from course_lib.classroom.grading.judge import judge, course_namespace\n"
              "from course_lib.classroom.checks._references import bind_references\n"
              "plan = grading_plan(['2.1'])['2.1']\n"
              "course_namespace()\n"
              "bind_references(checkers_too=True)\n"
              f"sandbox.enter({str(tmp_path)!r}, [], memory_mb=None, cpu_seconds=None)\n"
              f"verdicts = [judge(plan, source) for source in {[ATTACKS[name] for name in ORDER]!r}]\n"
              "open('verdicts.json', 'w').write(json.dumps(verdicts))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    verdicts = dict(zip(ORDER, json.loads((tmp_path / "verdicts.json").read_text())))
    for name, verdict in verdicts.items():
        assert (verdict["passed"], verdict["diagnosis"]) == (False, "patched"), (name, verdict)
        assert "left code to run unasked" in verdict["message"], (name, verdict)


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
