"""A twenty-fifth attack, on the reference guard's watcher itself (2026-12-01): the student's code reaches it through
``sys.getprofile()`` (or ``threading.getprofile()``), switches it off while it calls the course's answer, and puts it
back before the check ends, where no comparison of the course's state sees it.

- The watcher was a method of an object: ``sys.getprofile().__self__.codes = frozenset()`` (and its ``namesets``)
  left it watching nothing, in the notebook and in the grader. What it watches is one exact tuple now.
- Its class's method ``_guard._watch`` could be swapped for one that does nothing and swapped back; so could a
  name of the module it looks up. The watcher and its helpers are bound as defaults (a code attribute, which the
  grader's sandbox refuses to set).
- A trip the student's code caught could be taken back (``guard.tripped = None``): a trip is counted by a counter
  that only counts up, whose first value the guard keeps where no code of the student's reaches.
"""
from __future__ import annotations

import platform
import sys

import pytest
from sandboxed_judge import judged_in_sandbox

from course_lib import attention
from course_lib.classroom import checks

LINUX = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")
_HEAD = ("import sys, threading, torch\nfrom course_lib import attention\n"
         "from course_lib.classroom.checks.engine import run as _run\ndef causal_mask(n):\n")
_CALL = "    try:\n        return attention.causal_mask(n)\n    finally:\n"

# each calls the course's causal_mask with the watcher switched off for the call, then puts everything back
SWITCHED_OFF = {
    "the watcher's object emptied": (
        _HEAD + "    hook = getattr(sys.getprofile(), '__self__', None)\n    try:\n"
        "        hook.codes = hook.namesets = frozenset()\n    except (AttributeError, TypeError):\n        pass\n"
        "    return attention.causal_mask(n)\n"),
    "threading's watcher emptied": (
        _HEAD + "    hook = getattr(threading.getprofile(), '__self__', None)\n    try:\n"
        "        hook.codes = hook.namesets = frozenset()\n    except (AttributeError, TypeError):\n        pass\n"
        "    return attention.causal_mask(n)\n"),
    "the guard's method swapped and back": (
        _HEAD + "    old = getattr(_run._guard, '_watch', None)\n    _run._guard._watch = lambda *a, **k: None\n"
        + _CALL + "        _run._guard._watch = old\n"),
    "the module's watcher swapped and back": (
        _HEAD + "    old = _run._watch\n    _run._watch = lambda *a, **k: None\n" + _CALL + "        _run._watch = old\n"),
    "the module's file test swapped and back": (
        _HEAD + "    old = _run.is_student_file\n    _run.is_student_file = lambda f: False\n" + _CALL
        + "        _run.is_student_file = old\n"),
    "a trip caught and its records cleared": (
        _HEAD + "    try:\n        mask = attention.causal_mask(n)\n    except BaseException:\n"
        "        mask = torch.ones(n, n, dtype=torch.bool).tril()\n"
        "    for item in getattr(sys.getprofile(), '__self__', ()):\n"
        "        if type(item) is list:\n            item.clear()\n    return mask\n"),
}
HONEST = {"right": "import torch\ndef causal_mask(n):\n    return torch.ones(n, n, dtype=torch.bool).tril()\n"}


def _defined(source: str):
    namespace: dict = {}
    exec(compile(source, "<student>", "exec"), namespace)   # noqa: S102 - the attack, as a notebook cell runs it
    return namespace["causal_mask"]


@pytest.mark.parametrize("name", SWITCHED_OFF)
def test_the_watcher_switched_off_in_a_notebook_is_still_the_courses_answer(name, check_process):
    result = checks.check_causal_mask(_defined(SWITCHED_OFF[name]), graded=False)
    assert (result.passed, result.diagnosis) == (False, "calls_reference"), (name, result)
    assert checks.check_causal_mask(_defined(HONEST["right"]), graded=False).passed
    assert attention.causal_mask(3).sum() == 6   # the course's own, as it was


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="the sandbox as a forked exercise's process enters it")
def test_the_twenty_fifth_attacks_are_the_courses_answer_and_honest_code_passes(tmp_path):
    verdicts = iter(judged_in_sandbox(tmp_path, "2.1", [*HONEST.values(), *SWITCHED_OFF.values()]))
    for name, verdict in zip(HONEST, verdicts):
        assert verdict["passed"] is True, (name, verdict)
    for name, verdict in zip(SWITCHED_OFF, verdicts):
        assert verdict["passed"] is False and verdict["diagnosis"] in ("calls_reference", "patched"), (name, verdict)
