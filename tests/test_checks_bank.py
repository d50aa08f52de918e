"""The one runner of every bank of student attempts (tests/bank), driven by the exercise table.

Each attempt is judged by the checker the table names for its exercise (``classroom.exercises``): a
correct attempt passes, a buggy one gets its diagnosis and a message with the words the bank asks for.
The table and the checkers agree both ways, and every checker ported to the engine has a counter-example.
"""
from __future__ import annotations

import inspect
import subprocess
import sys
import warnings

import pytest
from bank import (
    attention_bugs,
    contract_bugs,
    flash_bugs,
    heads_bugs,
    learning_bugs,
    model_bugs,
    modern_bugs,
    pairs_bugs,
    precision_bugs,
    probe_bugs,
    scale_bugs,
    search19_bugs,
    search22_bugs,
    search25_bugs,
    search26_bugs,
    search27_bugs,
    search28_bugs,
    search29_bugs,
    search30_bugs,
    search30b_bugs,
    search30c_bugs,
    search30d_bugs,
    search30e_bugs,
    search31a_bugs,
    search31b_bugs,
    search31c_bugs,
    search32_bugs,
    search32p_bugs,
    search32q_bugs,
    search32r_bugs,
    search32s_bugs,
    search32t_bugs,
    search33a_bugs,
    search33b_bugs,
    search33c_bugs,
    search33d_bugs,
    search34q_bugs,
    search34r_bugs,
    search35a_bugs,
    search35b_bugs,
    search35c_bugs,
    search35d_bugs,
    search36a_bugs,
    search36b_bugs,
    search37a_bugs,
    search37b_bugs,
    search38_bugs,
    search39_bugs,
    search40a_bugs,
    search40b_bugs,
    search41a_bugs,
    search42a_bugs,
    search42b_bugs,
    search_bugs,
    state_bugs,
    text_bugs,
    variants_bugs,
)

from course_lib.classroom import checks, verdict
from course_lib.classroom.checks.engine import PROBES, FunctionExercise, run
from course_lib.classroom.exercises import BY_ID, EXERCISES

BANKS = (attention_bugs, model_bugs, modern_bugs, flash_bugs, heads_bugs, variants_bugs, probe_bugs, search_bugs,
         search19_bugs, search22_bugs, scale_bugs, learning_bugs, state_bugs, pairs_bugs, contract_bugs, text_bugs,
         precision_bugs, search25_bugs, search26_bugs, search27_bugs, search28_bugs,
         search29_bugs, search30_bugs, search30b_bugs, search30c_bugs, search30d_bugs,
         search30e_bugs, search31a_bugs, search31b_bugs, search31c_bugs,
         search32_bugs, search32p_bugs, search32q_bugs, search32r_bugs, search32s_bugs,
         search32t_bugs, search33a_bugs, search33b_bugs, search33c_bugs, search33d_bugs,
         search34q_bugs, search34r_bugs, search35a_bugs, search35b_bugs,
         search35c_bugs, search35d_bugs, search36a_bugs, search36b_bugs,
         search37a_bugs, search37b_bugs, search38_bugs, search39_bugs, search40a_bugs, search40b_bugs,
         search41a_bugs, search42a_bugs, search42b_bugs)
BUGGY = [attempt for bank in BANKS for attempt in bank.BUGGY]
CORRECT = [attempt for bank in BANKS for attempt in bank.CORRECT]

# Notebooks whose exercises run on the engine (checks/DESIGN.md): each declares its counter-example.
PORTED = ("01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "12")   # every notebook


def _answers(check) -> int:
    """How many answers a checker takes from the student: its parameters without a default."""
    return sum(p.default is inspect.Parameter.empty for p in inspect.signature(check).parameters.values())


def judged(attempt):
    """The verdict of the exercise's checker on the attempt. A checker of several answers (1.1: the weights and
    the result) gets them from a tuple; some attempts carry options of the checker (``norm_first=False``)."""
    check = getattr(checks, BY_ID[attempt.exercise].checker)
    answers = attempt.candidate if _answers(check) > 1 else (attempt.candidate,)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # students' code may warn (implicit softmax dim, ...)
        return check(*answers, **getattr(attempt, "kwargs", {}))


@pytest.fixture
def in_process(monkeypatch):
    """The bank is about verdicts, so it judges in this process, as the grader's sandbox and macOS do: a
    forked child of a pytest worker costs several times the check itself. The child that a Linux kernel
    uses is tested on its own (test_check_time_limit, test_checks_harness) and gives the bank's verdicts
    below (test_a_forked_child_gives_the_banks_verdict)."""
    monkeypatch.setenv("COURSE_CHECK_IN_PROCESS", "1")
    assert not run.can_fork()


@pytest.mark.parametrize("attempt", CORRECT, ids=[a.id for a in CORRECT])
def test_correct_attempt_passes(attempt, in_process):
    result = judged(attempt)
    assert result.passed, f"{attempt.id} rejected: {result}"


@pytest.mark.parametrize("attempt", BUGGY, ids=[a.id for a in BUGGY])
def test_buggy_attempt_gets_its_diagnosis(attempt, in_process):
    assert_diagnosed(attempt, judged(attempt))


def assert_diagnosed(attempt, result):
    assert not result.passed, f"{attempt.id} passed: {result}"
    assert result.diagnosis == attempt.expected, f"{attempt.id}: {result}"
    assert result.diagnosis in verdict.DIAGNOSES
    assert len(result.message) > 30 and "Traceback" not in result.message
    for word in getattr(attempt, "says", ()):   # the older banks name no words
        assert word.lower() in result.message.lower(), f"{attempt.id}: {word!r} not in {result.message!r}"


# the first right and the first wrong attempt at every exercise, judged in a forked child as a Linux kernel does
FORKED = [(next(a for a in attempts if a.exercise == exercise), attempts is CORRECT)
          for attempts in (CORRECT, BUGGY) for exercise in sorted({a.exercise for a in attempts})]


@pytest.mark.skipif(not run.can_fork(), reason="this platform has no forked child (engine.run)")
@pytest.mark.parametrize("attempt, correct", FORKED, ids=[a.id for a, _ in FORKED])
def test_a_forked_child_gives_the_banks_verdict(attempt, correct):
    result = judged(attempt)
    if correct:
        assert result.passed, f"{attempt.id} rejected: {result}"
    else:
        assert_diagnosed(attempt, result)


def test_every_attempt_is_at_an_exercise_of_the_table():
    assert {a.exercise for a in BUGGY + CORRECT} <= set(BY_ID)
    ids = [a.id for a in BUGGY + CORRECT]
    assert len(ids) == len(set(ids)), "two attempts share a name"


def test_the_table_and_the_checkers_agree():
    checkers = {name: getattr(checks, name) for name in dir(checks) if name.startswith("check_")}
    assert {entry.checker for entry in EXERCISES} == set(checkers)
    for entry in EXERCISES:
        assert checkers[entry.checker].exercise == entry.id, entry
    assert [entry.id for entry in EXERCISES] == sorted(BY_ID, key=lambda i: tuple(map(int, i.split("."))))


def _declarations():
    return [value for name in dir(checks) if name.startswith("notebook")
            for value in vars(getattr(checks, name)).values() if isinstance(value, FunctionExercise)]


def test_every_ported_checker_declares_its_counterexample():
    ported = [entry for entry in EXERCISES if entry.notebook in PORTED]
    assert {entry.notebook for entry in ported} == set(PORTED), "a ported notebook with no exercise in the table"
    missing = [entry.id for entry in ported if getattr(checks, entry.checker).example is None]
    assert not missing, f"checkers without a counter-example: {missing}"


def test_every_declaration_is_in_the_table_and_lists_known_probes():
    declared = _declarations()
    assert {d.id for d in declared} >= {"1.2", "1.3", "2.1", "3.1", "3.2", "4.1"}
    for declaration in declared:
        assert BY_ID[declaration.id].name == declaration.name, declaration.id
        assert set(declaration.probes) <= set(PROBES), (declaration.id, declaration.probes)
        assert {"mutation", "reference_guard", "counterexample"} <= set(declaration.probes), declaration.id


def test_every_declared_mistake_differs_from_the_reference_somewhere():
    """A mistake whose output is the reference's on every case would name a correct attempt."""
    for declaration in _declarations():
        cases = declaration.cases()
        for mistake in declaration.mistakes:
            outputs = []
            for case in cases:
                try:
                    outputs.append((declaration.mistaken(mistake, case), declaration.reference(*case.args)))
                except (RuntimeError, ValueError):   # a mistake that does not apply to this case's shapes
                    continue
            assert any(wrong is not None and not declaration.same(wrong, right) for wrong, right in outputs), \
                (declaration.id, mistake.message[:60])


def test_notebook12s_bank_has_issue_48s_numbers():
    """Issue 48 asks for at least 40 wrong and 10 correct attempts at notebook 12's exercises, all three covered."""
    assert {a.exercise for a in variants_bugs.BUGGY + variants_bugs.CORRECT} == {"12.1", "12.2", "12.3"}
    assert len(variants_bugs.BUGGY) >= 40 and len(variants_bugs.CORRECT) >= 10


@pytest.mark.parametrize("name", ["window_one_too_wide", "mla_unscaled", "mla_rope_from_zero_each_call",
                                  "linear_reads_before_the_update"])
def test_a_wrong_output_comes_with_a_counterexample(name):
    """The engine's counter-example runs the student's code as the check does (12.2: a copy of the layer and a
    LatentCache), so an output mistake is shown on a tiny input, not left without one."""
    attempt = next(a for a in variants_bugs.BUGGY if a.name == name)
    result = judged(attempt)
    assert not result.passed and "counterexample" in result.details, result


# Exercises with no course version for the guard to watch: a prediction, assembled parts, a function of a layer.
NO_REFERENCE = {"1.1", "8.1", "12.2"}


def test_every_reference_the_table_names_is_the_courses_own():
    from course_lib.classroom.checks.engine.run import reference_of
    for entry in EXERCISES:
        found = reference_of(entry.id)
        if entry.id in NO_REFERENCE:
            assert found is None and not entry.reference, entry
            continue
        assert found is not None, f"{entry.id}: reference {entry.reference!r} is not a course function or class"
        assert found.__name__ == entry.reference.rsplit(".", 1)[1] and found.__module__.startswith("course_lib.")


def test_checks_before_notebook_07_never_load_transformers():
    """The guard imports only the module the table names: a check of notebooks 01-06 in a kernel that never
    imported transformers leaves it unimported (it costs seconds, in every forked check)."""
    probe = ("import sys\n"
             "from course_lib.classroom import checks\n"
             "from course_lib.classroom.checks.engine.run import reference_of\n"
             "from course_lib.classroom.exercises import EXERCISES\n"
             "[reference_of(e.id) for e in EXERCISES if int(e.notebook) <= 6]\n"
             "assert checks.check_toy_prediction([0.2, 0.5, 0.3], [0.0, 0.0]).diagnosis\n"
             "print('transformers' in sys.modules)\n")
    ran = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "False"


def test_the_guard_watches_notebook_12s_own_references():
    """modern.sliding_window_mask (notebook 09, window only) shares 12.1's name; the guard must watch variants'
    mask with sinks, so a student who builds 12.1 on notebook 09's mask is not told they call the reference."""
    from course_lib.classroom.checks.engine.run import reference_of
    found = {entry.id: reference_of(entry.id) for entry in EXERCISES if entry.notebook == "12"}
    found = {exercise: ref for exercise, ref in found.items() if ref is not None}   # 12.2 is a function of a layer
    assert set(found) >= {"12.1", "12.3"}
    for exercise, ref in found.items():
        assert ref.__module__.startswith("course_lib.variants."), (exercise, ref.__module__)
