"""What a fourth scripted attack on the grader found (2026-11-29): the recorder's own closures, objects that claim
to be tensors, a working folder made read-only before 8.1, and e-mail addresses in feedback."""
from __future__ import annotations

import pytest

from course_lib.classroom import checks
from course_lib.classroom.grading import grading_plan
from course_lib.classroom.grading.judge import judge
from course_lib.classroom.grading.text import markdown_inline

# The checker the namespace's `checks` hands out, replaced in its module by one that says yes.
MODULE_CHECKER_SWAPPED = '''
from course_lib.classroom import checks as _course_checks
from course_lib.classroom.verdict import CheckResult as _Result

def causal_mask(n):
    _course_checks.check_causal_mask = lambda fn, **kw: _Result("2.1", True, None, "Right.")
    return torch.zeros(n, n)
'''

# The checkers reached from `checks` by plain attribute access (its lookup's closure), one replaced by a function
# that checks the course's answer instead.
CHECKER_SWAPPED = '''
def causal_mask(n):
    lookup = type(checks).__getattr__
    checkers = dict(zip(lookup.__code__.co_freevars, lookup.__closure__))["checkers"].cell_contents
    real = checkers["check_causal_mask"]
    checkers["check_causal_mask"] = lambda fn, **kw: real(lambda n: torch.ones(n, n, dtype=torch.bool).tril())
    return torch.zeros(n, n)
'''

# `checks`'s class given another lookup.
LOOKUP_SWAPPED = '''
def causal_mask(n):
    type(checks).__getattr__ = lambda self, name: (lambda *a, **k: None)
    return torch.zeros(n, n)
'''


@pytest.mark.parametrize("source", [MODULE_CHECKER_SWAPPED, CHECKER_SWAPPED, LOOKUP_SWAPPED],
                         ids=["module", "checker", "lookup"])
def test_what_checks_holds_changed_by_the_submission_changes_no_verdict(source, monkeypatch):
    """The grader makes the check cell's calls itself, with the checkers it took before any student code ran: what
    the namespace's `checks` holds (or its module) is the student's to change, and changes nothing."""
    monkeypatch.setenv("COURSE_CHECK_IN_PROCESS", "1")   # as in the grader's exercise process: no fork below it
    verdict = judge(grading_plan(["2.1"])["2.1"], source)
    assert verdict["passed"] is False and verdict["diagnosis"] in ("dtype", "causal_mask"), verdict


def test_an_untouched_recorder_still_judges():
    right = "def causal_mask(n):\n    return torch.ones(n, n, dtype=torch.bool).tril()\n"
    assert judge(grading_plan(["2.1"])["2.1"], right)["passed"] is True
    assert judge(grading_plan(["2.1"])["2.1"], "def causal_mask(n):\n    return torch.zeros(n, n)\n")["diagnosis"] \
        in ("dtype", "causal_mask")


class _ClaimsToBeATensor:
    """Not a tensor, yet isinstance(x, torch.Tensor) says so, and torch hands it every function of its arguments."""

    __class__ = property(lambda self: __import__("torch").Tensor)   # type: ignore[assignment]

    def __init__(self, shape):
        self.shape = shape

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return True


def test_an_object_that_claims_to_be_a_tensor_is_refused():
    import torch
    assert isinstance(_ClaimsToBeATensor((2, 2)), torch.Tensor)   # the lie the checks must not believe
    result = checks.check_causal_mask(lambda n: _ClaimsToBeATensor((n, n)), graded=False)
    assert not result.passed and result.diagnosis == "dtype" and "claims to be a torch.Tensor" in result.message
    result = checks.check_merge_heads(lambda x: _ClaimsToBeATensor((x.shape[0], x.shape[2], x.shape[1] * x.shape[3])),
                                      graded=False)
    assert not result.passed and result.diagnosis == "dtype", result


def test_an_e_mail_address_in_feedback_is_shown_as_code():
    shown = markdown_inline("write to eve@grading.example or mailto:x.y+z@portal.example.org")
    assert "`eve@grading.example`" in shown and "`mailto:x.y+z@portal.example.org`" in shown


def test_a_working_folder_made_read_only_is_writable_again_for_8_1(tmp_path):
    """Code of an earlier exercise ran os.chmod(".", 0o555): 8.1's copy of the notebooks as handed in still goes
    there (it made the whole run fail, 'grading failed', as the student user)."""
    import os
    import stat

    from course_lib.classroom.grading import worker
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o555)
    folder = worker._as_handed_in(str(home), {"02_masked_attention.ipynb": b"{}"})
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700
    assert os.path.dirname(folder) == str(home)
    assert open(os.path.join(folder, "02_masked_attention.ipynb"), "rb").read() == b"{}"
