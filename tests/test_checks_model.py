"""The checkers of notebooks 04-07 (exercises 4.1-7.2) against the references and a bank of student attempts."""
from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from bank.model_bugs import BUGGY, CORRECT, hf_attention_matmul

from course_lib.classroom import checks, exercises, verdict
from course_lib.classroom.checks import _core
from course_lib.data import lm_windows
from course_lib.generate import generate_with_cache, sample_next_token
from course_lib.hf import split_c_attn
from course_lib.model import GPT, TransformerBlock, sinusoidal_table
from course_lib.train import flops_per_token, lm_loss, train_step

CHECKERS = {
    "4.1": checks.check_sinusoidal_table,
    "4.2": checks.check_transformer_block,
    "4.3": checks.check_gpt,
    "5.1": checks.check_lm_windows,
    "5.2": checks.check_lm_loss,
    "5.3": checks.check_train_step,
    "5.4": checks.check_sampling,
    "6.1": checks.check_flops_per_token,
    "6.2": checks.check_kv_cache,
    "7.1": checks.check_split_c_attn,
    "7.2": checks.check_hf_attention,
}

REFERENCES = {
    "4.1": sinusoidal_table,
    "4.2": TransformerBlock,
    "4.3": GPT,
    "5.1": lm_windows,
    "5.2": lm_loss,
    "5.3": train_step,
    "5.4": sample_next_token,
    "6.1": flops_per_token,
    "6.2": generate_with_cache,
    "7.1": split_c_attn,
    "7.2": hf_attention_matmul,   # a student's: the course's hf.course_attention_forward is guarded for 7.2
}

CLASS_EXERCISES = ("4.2", "4.3")


def run(exercise, candidate, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # students' code may warn
        return CHECKERS[exercise](candidate, **kwargs)


# ---------------------------------------------------------------- reference and bank

@pytest.mark.parametrize("exercise", sorted(CHECKERS))
def test_reference_passes(exercise):
    result = run(exercise, REFERENCES[exercise])
    assert result.passed, result.message
    assert result.diagnosis is None and result.exercise == exercise


def test_post_norm_reference_passes_the_post_norm_check():
    # the reference has a norm_first argument, so the checker builds it post-norm
    assert run("4.2", TransformerBlock, norm_first=False).passed


def test_bank_size_and_coverage():
    assert len(BUGGY) >= 35 and len(CORRECT) >= 10
    exercises = {a.exercise for a in BUGGY} & {a.exercise for a in CORRECT}
    assert exercises == set(CHECKERS), "every exercise has buggy and correct attempts"
    codes = Counter(a.expected for a in BUGGY)
    for code in ("not_implemented", "exception", "shape", "dtype", "softmax_dim", "scale", "normalization",
                 "causal_mask", "dropout", "residual", "norm_placement", "mismatch",
                 "mutation", "clipping", "generator",   # issue 11's classes
                 "gradient", "batch_mixing", "kv_cache",   # issue 20's
                 "zero_grad", "flops_factor", "split_transpose", "final_norm", "no_kv_cache",
                 "overlapping_windows"):   # issue 21's own codes
        assert codes[code] > 0, code
    gradient = {a.exercise for a in BUGGY if a.expected == "gradient"}
    assert {"4.2", "4.3", "5.2", "7.2"} <= gradient, "every differentiable checker meets a cut graph"
    assert len({a.id for a in BUGGY + CORRECT}) == len(BUGGY + CORRECT), "attempt names are unique"


# ---------------------------------------------------------------- a checker never raises

def _raises_value_error(*args, **kwargs):
    raise ValueError("operands could not be broadcast together")


def _not_written(*args, **kwargs):
    raise NotImplementedError("Exercise: write it")


class _NotAModule:
    def __init__(self, *args, **kwargs):
        pass


# Issue 43: the mistakes of notebooks 04-06 that ended in mismatch, each named by a code of its own.
DIAGNOSES_ADDED_FOR_43 = ("sincos_layout", "positions", "sublayer_missing", "block_chain", "logits", "context_limit",
                          "target_shift", "loss_reduction", "step_order", "greedy", "top_k", "attention_flops",
                          "flops_units", "weights_count")


def test_issue_43s_codes_are_diagnoses_each_tested_by_two_attempts_at_least():
    assert set(DIAGNOSES_ADDED_FOR_43) <= set(verdict.DIAGNOSES)
    codes = Counter(a.expected for a in BUGGY if a.exercise[0] in "456")
    assert all(codes[code] >= 2 for code in DIAGNOSES_ADDED_FOR_43), codes   # a class, not one example
    wrong = [a for a in BUGGY if a.exercise[0] in "456"]
    named = [a for a in wrong if a.expected != "mismatch"]
    assert len(named) >= 0.95 * len(wrong), [a.id for a in wrong if a.expected == "mismatch"]


def test_every_named_slip_of_the_flops_count_differs_from_the_count():
    """The formula variants of 6.1 (one part of 12·n·H·Q·T changed, or several; other units; embeddings added):
    none gives the right count on every configuration, and no two give the same numbers on all of them."""
    from course_lib.classroom.checks import notebook06
    cases = notebook06.FLOPS_PER_TOKEN.cases()
    seen = {}
    for mistake in notebook06._SLIPS:
        counts = tuple(float(mistake.output(*case.args)) for case in cases)
        assert counts != tuple(float(notebook06.FLOPS_PER_TOKEN.reference(*case.args)) for case in cases)
        assert counts not in seen, (mistake.message, seen.get(counts))
        seen[counts] = mistake.message


class _RaisingModule(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()
        raise NotImplementedError("Exercise: write it")


ODD_FUNCTIONS = [
    ("returns_none", lambda *args, **kwargs: None, {"shape", "dtype"}),
    ("returns_string", lambda *args, **kwargs: "tokens", {"dtype", "shape"}),
    # a train_step that returns a number and trains nothing has neither backward nor step: step_order (5.3)
    ("returns_scalar_tensor", lambda *args, **kwargs: torch.tensor(0.5), {"shape", "dtype", "mismatch", "step_order"}),
    ("raises_value_error", _raises_value_error, {"exception"}),
    ("not_callable", 42, {"exception"}),
]


@pytest.mark.parametrize("exercise", sorted(CHECKERS))
@pytest.mark.parametrize("name,candidate,codes", ODD_FUNCTIONS, ids=[c[0] for c in ODD_FUNCTIONS])
def test_checker_never_raises(exercise, name, candidate, codes):
    result = run(exercise, candidate)
    assert isinstance(result, verdict.CheckResult) and not result.passed
    if exercise in CLASS_EXERCISES:
        # a function is not a class: what it "constructs" is not an nn.Module
        assert result.diagnosis == "exception", result
        assert "nn.Module" in result.message or name == "raises_value_error", result
    else:
        assert result.diagnosis in codes, result


@pytest.mark.parametrize("exercise", sorted(CHECKERS))
def test_not_implemented_is_polite(exercise):
    candidate = _RaisingModule if exercise in CLASS_EXERCISES else _not_written
    result = run(exercise, candidate)
    assert result.diagnosis == "not_implemented", result
    assert "NotImplementedError" in result.message


@pytest.mark.parametrize("exercise", CLASS_EXERCISES)
def test_class_checkers_report_classes_that_are_not_modules(exercise):
    result = run(exercise, _NotAModule)
    assert result.diagnosis == "exception" and "nn.Module" in result.message


def test_checks_leave_global_state_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    threads = torch.get_num_threads()
    torch.manual_seed(123)
    run("5.4", sample_next_token)
    run("6.2", generate_with_cache)
    assert torch.equal(torch.rand(3), expected)
    assert torch.get_num_threads() == threads


# ---------------------------------------------------------------- messages, hints, solutions

def test_train_step_returning_a_tensor_passes_with_a_note():
    by_id = {a.id: a for a in CORRECT}
    result = run("5.3", by_id["5.3-step_returns_tensor"].candidate)
    assert result.passed and ".item()" in result.message


def test_kv_cache_reports_the_speed():
    result = run("6.2", generate_with_cache)
    assert "ms with your cache" in result.message and "without" in result.message


def test_gpt_check_says_whether_the_cache_path_was_checked():
    by_id = {a.id: a for a in CORRECT}
    assert "cached path gives the same logits" in run("4.3", GPT).message
    assert "does not use its cache" in run("4.3", by_id["4.3-GPTIgnoresCache"].candidate).message
    assert "not written yet" in run("4.3", by_id["4.3-GPTCacheLeftForLater"].candidate).message
    assert "cache" not in run("4.3", by_id["4.3-GPTNoCache"].candidate).message


@pytest.mark.parametrize("exercise", sorted(CHECKERS))
def test_hints_and_solutions_are_registered(exercise, capsys):
    entry, state = exercises.exercise(exercise), _core.hint_state(exercise)
    state.shown = 0
    assert 2 <= len(entry.hints) <= 3
    texts = [checks.hint(exercise) for _ in range(len(entry.hints) + 1)]
    assert texts[0].startswith(f"Hint 1/{len(entry.hints)} for exercise {exercise}")
    assert texts[-1] == texts[-2]
    source = checks.show_solution(exercise, force=True)
    assert "def " in source or "class " in source
    state.shown = 0


# ---------------------------------------------------------------- 8.1 trains like the reference

def test_check_trains_like_reference_returns_judges_verdict(capsys):
    from course_lib.classroom.training_runs import TrainingRun, judge
    reference = TrainingRun("reference", [1, 2], [3.0, 2.0], [2], [1.5])
    runs = [TrainingRun("y", [1, 2], [3.0, 2.0], [2], [1.51]),            # within the tolerance
            TrainingRun("y", [1, 2], [3.0, 2.0], [2], [1.6]),             # behind
            TrainingRun("y", [1], [3.0], [], [], failure="nan")]          # NaN in training
    def verdict(result):   # a failed check also carries its counter-example (the two curves), judge's does not
        return result.exercise, result.passed, result.diagnosis, result.message

    for run in runs:
        assert verdict(checks.check_trains_like_reference(run, reference)) == verdict(judge(run, reference))
    assert verdict(checks.check_trains_like_reference(runs[1], reference, tolerance=0.2)) == \
        verdict(judge(runs[1], reference, 0.2))
    assert "counterexample" in checks.check_trains_like_reference(runs[1], reference).details
    assert checks.check_trains_like_reference(runs[1], reference, tolerance=0.2).passed
    wrong = checks.check_trains_like_reference("not a run", reference)   # answers, never raises
    assert not wrong.passed and wrong.exercise == "8.1" and "TrainingRun" in wrong.message
    swapped = checks.check_trains_like_reference(reference, runs[2])      # the failed run passed second
    assert swapped.diagnosis == "exception" and "your run first" in swapped.message
    # runs as train_parts marks them: the reference's asked for none of your parts, yours for every usable one
    mine, course = TrainingRun("yours", [1, 2], [3.0, 2.0], [2], [1.8], not_yours=()), \
        TrainingRun("reference", [1, 2], [3.0, 2.0], [2], [1.5], yours_asked=())
    assert checks.check_trains_like_reference(mine, course).diagnosis == "mismatch"   # behind, as it is
    failed = TrainingRun("yours", [1], [3.0], [], [], failure="nan", not_yours=())
    for misuse, words in (((course, course), "same run"), ((mine, mine), "same run"), ((failed, failed), "same run"),
                          ((course, mine), "your run first"), ((course, reference), "course's parts only"),
                          ((mine, TrainingRun("r", [1, 2], [3.0, 2.0], [2], [1.5], not_yours=())),
                           "trained your parts"),
                          ((TrainingRun("yours", [1, 2], [3.0, 2.0], [2], [1.5], yours_asked=("2.1",)), course),
                           "only some of your parts"),
                          ((TrainingRun("yours", [1, 2], [3.0, 2.0], [2], [1.5], trained_on=("names", 0, 3e-3)),
                            TrainingRun("reference", [1, 2], [3.0, 2.0], [2], [1.6], yours_asked=(),
                                        trained_on=("names", 1, 3e-3))), "not the same training"),
                          ((mine, TrainingRun("reference", [1, 2, 3], [3.0, 2.0, 1.9], [3], [1.5], yours_asked=())),
                           "validated at steps")):
        result = checks.check_trains_like_reference(*misuse)   # never 'BELOW', never a bug in the course
        assert (result.passed, result.diagnosis) == (False, "exception") and words in result.message, result.message
    state = _core.hint_state("8.1")
    state.shown, state.step, state.followed = 0, 0, None
    # after the failed check, the first hint answers that verdict; the next ones are the spec's, in order
    assert "after your last check (exception)" in checks.hint("8.1")
    assert checks.hint("8.1").startswith("Hint 1/2 for exercise 8.1") and "train_parts" in capsys.readouterr().out
    state.shown = 0
    assert "no solution" in checks.show_solution("8.1") and "no solution" in capsys.readouterr().out
