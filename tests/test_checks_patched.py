"""Issue 43, global state: torch's own functions replaced by the student's code are a verdict of their own.

A replacement of ``torch.equal`` made when a cell runs (a default argument is enough) made an all-True causal
mask pass 2.1, in the notebook and in the grader; a replacement of ``F.softmax`` leaked into every later check.
Now a check finds either before it compares anything (``patched``), leaves the kernel as it found it, and a
correct answer passes again once the replacement is gone. torch's own updates of itself are not replacements.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib.classroom import checks
from course_lib.classroom.checks import _pinned as pinned
from course_lib.classroom.grading import grading_plan
from course_lib.classroom.grading.judge import judge

ALL_TRUE_SOURCE = ("import torch\n"
                   "def causal_mask(n, _p=setattr(torch, 'equal', lambda *a, **k: True)):\n"
                   "    return torch.ones(n, n, dtype=torch.bool)\n")


def right_mask(n):
    return torch.tril(torch.ones(n, n, dtype=torch.bool))


@pytest.fixture(params=["forked", "in process"])
def where(request, monkeypatch):
    """Checks run in a forked child in a notebook, in process in the grader's sandbox: both must hold."""
    if request.param == "in process":
        monkeypatch.setenv("COURSE_CHECK_IN_PROCESS", "1")
    return request.param


def test_torch_equal_replaced_when_a_cell_runs_is_the_verdict_patched(monkeypatch, where):
    equal = torch.equal

    def causal_mask(n, _p=monkeypatch.setattr(torch, "equal", lambda *a, **k: True)):  # noqa: B008 (the attack)
        return torch.ones(n, n, dtype=torch.bool)

    result = checks.check_causal_mask(causal_mask)
    assert (result.passed, result.diagnosis) == (False, "patched"), result
    assert "torch.equal" in result.message and "restart the kernel" in result.message
    assert torch.equal is not equal, "a check must leave the kernel as it found it, the student's patch too"
    monkeypatch.setattr(torch, "equal", equal)
    assert checks.check_causal_mask(right_mask).passed
    assert checks.check_causal_mask(causal_mask).diagnosis == "causal_mask"   # judged on its merits again


@pytest.mark.parametrize("patch", [
    lambda: setattr(F, "softmax", lambda x, dim=None, **k: x),
    lambda: setattr(torch.Tensor, "softmax", lambda self, dim=None, **k: self),   # hides TensorBase's own
    lambda: setattr(nn.Linear, "forward", lambda self, x: x),
    lambda: setattr(torch, "allclose", functools.partial(lambda *a, **k: True)),
    lambda: setattr(torch.Tensor, "__eq__", lambda self, other: torch.ones_like(self, dtype=torch.bool)),
], ids=["F.softmax", "Tensor.softmax", "nn.Linear.forward", "torch.allclose partial", "Tensor.__eq__"])
def test_a_replacement_made_while_the_students_code_runs_is_found_and_undone(patch, where):
    before = (F.softmax, vars(torch.Tensor).get("softmax"), nn.Linear.forward, torch.allclose,
              vars(torch.Tensor).get("__eq__"))

    def causal_mask(n):
        patch()
        return right_mask(n)

    result = checks.check_causal_mask(causal_mask)
    assert (result.passed, result.diagnosis) == (False, "patched"), result
    after = (F.softmax, vars(torch.Tensor).get("softmax"), nn.Linear.forward, torch.allclose,
             vars(torch.Tensor).get("__eq__"))
    assert all(a is b for a, b in zip(before, after)), "the check must undo what the student's code replaced"
    assert pinned.replaced() == []
    assert checks.check_causal_mask(right_mask).passed   # a later check is not blamed for it


def test_a_replacement_made_before_the_checks_were_imported_is_found(monkeypatch):
    """Pinned after the student's code ran (a notebook run out of order): a function written in the student's
    code found where torch's own belongs is the same verdict."""
    fake = eval(compile("lambda *a, **k: True", "<your 02_masked_attention.ipynb, Exercise 2.1>", "eval"))
    monkeypatch.setattr(torch, "equal", fake)
    # a pin taken now, undone after the test (accept() pins nothing for a caller outside the course, as this test is)
    now = {key: (shown, space, vars(space)[key[1]]) for key, (shown, space, _) in pinned.PINNED.items()}
    monkeypatch.setattr(pinned, "PINNED", now)
    monkeypatch.setattr(pinned, "_BY_SPACE", pinned._by_space(now))
    assert pinned.replaced() == []
    assert pinned.replaced(written=True) == ["torch.equal"]
    result = checks.check_causal_mask(lambda n: torch.ones(n, n, dtype=torch.bool))
    assert result.diagnosis == "patched", result


@pytest.mark.slow
def test_torch_wrapping_its_own_functions_is_not_a_replacement():
    import torch._dynamo  # noqa: F401  (wraps torch.manual_seed in torch's own code)
    compiled = torch.compile(lambda x: torch.softmax(x, -1) * 2)   # wraps nn.Module.__init__, __setstate__
    compiled(torch.randn(3, 4))
    assert pinned.replaced(written=True) == []
    assert checks.check_causal_mask(right_mask).passed


def test_the_grader_gives_the_same_verdict_to_the_scripted_attack():
    equal = torch.equal
    try:
        verdict = judge(grading_plan()["2.1"], ALL_TRUE_SOURCE)
    finally:
        torch.equal = equal   # the grader's worker is a fresh child per student; this test runs in process
    assert (verdict["passed"], verdict["diagnosis"]) == (False, "patched"), verdict


def test_libraries_in_the_interpreters_other_site_folders_are_not_the_students():
    # Debian's and Ubuntu's system Python keeps apt's libraries (IPython, ipykernel) in /usr/lib/python3/dist-packages,
    # which sysconfig's paths leave out: IPython's own builtins.display was taken for a student's patch
    import subprocess
    import sys
    probe = ("import site; site.getsitepackages = lambda: ['/usr/lib/python3/dist-packages']\n"
             "from course_lib.classroom.checks import _student_files as files\n"
             "print(files.is_student_file('/usr/lib/python3/dist-packages/IPython/core/display_functions.py'),\n"
             "      files.is_student_file('/home/student/helper.py'))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "True"], done.stderr[-2000:]
