"""Notebook 12's bank (tests/bank/variants_bugs.py), judged as tests/test_checks_bank.py judges every bank.

Kept beside the shared runner so that the banks of several notebooks can be added at once without editing the
same lines; it holds notebook 12 to the runner's rules: each attempt gets its checker's verdict and words, the
table and the checkers agree, every checker of the notebook declares a counter-example, and the bank reaches
the numbers issue 48 asks for (40 wrong attempts, 10 correct).
"""
from __future__ import annotations

import warnings

import pytest
from bank import variants_bugs
from bank.attempts import assert_judged

from course_lib.classroom import checks, verdict
from course_lib.classroom.exercises import BY_ID, EXERCISES

ATTEMPTS = variants_bugs.BUGGY + variants_bugs.CORRECT


def judged(attempt):
    check = getattr(checks, BY_ID[attempt.exercise].checker)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check(attempt.candidate)


@pytest.mark.parametrize("attempt", ATTEMPTS, ids=[a.id for a in ATTEMPTS])
def test_attempt_gets_its_verdict(attempt):
    result = judged(attempt)
    assert result.diagnosis is None or result.diagnosis in verdict.DIAGNOSES
    assert_judged(result, attempt)


def test_bank_covers_the_three_exercises_with_issue_48s_numbers():
    assert {a.exercise for a in ATTEMPTS} == {"12.1", "12.2", "12.3"}
    assert len({a.id for a in ATTEMPTS}) == len(ATTEMPTS), "two attempts share a name"
    assert len(variants_bugs.BUGGY) >= 40 and len(variants_bugs.CORRECT) >= 10


def test_notebook12_checkers_are_in_the_table_and_declare_counterexamples():
    ours = [entry for entry in EXERCISES if entry.notebook == "12"]
    assert [entry.id for entry in ours] == ["12.1", "12.2", "12.3"]
    for entry in ours:
        check = getattr(checks, entry.checker)
        assert check.exercise == entry.id and check.example is not None, entry.id


@pytest.mark.parametrize("name", ["window_one_too_wide", "mla_unscaled", "mla_rope_from_zero_each_call",
                                  "linear_reads_before_the_update"])
def test_a_wrong_output_comes_with_a_counterexample(name):
    """The engine's counter-example runs the student's code as the check does (12.2: a copy of the layer and a
    LatentCache), so an output mistake is shown on a tiny input, not left without one."""
    attempt = next(a for a in variants_bugs.BUGGY if a.name == name)
    result = judged(attempt)
    assert not result.passed and "counterexample" in result.details, result
