"""The checkers of notebook 09 (exercises 9.1-9.6) against the references and a bank of student attempts."""
from __future__ import annotations

import importlib
import random
import warnings
import weakref
from collections import Counter

import numpy as np
import pytest
import torch
from bank.modern_bugs import BUGGY, CORRECT

from course_lib import modern
from course_lib.classroom import checks, exercises, verdict
from course_lib.classroom.checks import _core, _gqa_variants, notebook09
from course_lib.classroom.exercises import Mistake

CHECKERS = {
    "9.1": checks.check_rope_tables,
    "9.2": checks.check_apply_rotary,
    "9.3": checks.check_rms_norm,
    "9.4": checks.check_swiglu,
    "9.5": checks.check_repeat_kv,
    "9.6": checks.check_grouped_query_attention,
}

REFERENCES = {
    "9.1": modern.rope_tables,
    "9.2": modern.apply_rotary,
    "9.3": modern.RMSNorm,
    "9.4": modern.SwiGLU,
    "9.5": modern.repeat_kv,
    "9.6": modern.GroupedQueryAttention,
}

CLASS_EXERCISES = ("9.3", "9.4", "9.6")

# The mistakes the issue names, each with the diagnosis a bank attempt must get for it.
ISSUE_MISTAKES = {
    "rotating interleaved pairs against a half-split table": ("9.2", "rope_layout"),
    "rotating the values": ("9.6", "rotated_values"),
    "the wrong position offset during cached decoding": ("9.6", "rope_positions"),
    "repeat where repeat_interleave is meant": ("9.5", "kv_grouping"),
    "RoPE with the wrong shape: before the head split or along the head axis": ("9.6", "rope_axes"),
    "base/theta slips": ("9.1", "rope_frequencies"),
    "forgetting the RMSNorm epsilon": ("9.3", "epsilon"),
    "forgetting the RMSNorm weight": ("9.3", "norm_weight"),
    "SiLU on the wrong branch": ("9.4", "gating"),
    "GQA groups mapped in the wrong order": ("9.6", "kv_grouping"),
}


def run(exercise, candidate):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # students' code may warn
        return CHECKERS[exercise](candidate)


# ---------------------------------------------------------------- reference and bank

@pytest.mark.parametrize("exercise", sorted(CHECKERS))
def test_reference_passes(exercise):
    result = run(exercise, REFERENCES[exercise])
    assert result.passed, result.message
    assert result.diagnosis is None and result.exercise == exercise


def test_bank_size_and_coverage():
    assert len(BUGGY) >= 40 and len(CORRECT) >= 8
    for exercise in CHECKERS:
        assert any(a.exercise == exercise for a in BUGGY), f"no buggy attempt at {exercise}"
        assert any(a.exercise == exercise for a in CORRECT), f"no correct attempt at {exercise}"
    got = {(a.exercise, a.expected) for a in BUGGY}
    missing = [mistake for mistake, key in ISSUE_MISTAKES.items() if key not in got]
    assert not missing, f"the bank has no attempt for: {missing}"
    codes = Counter(a.expected for a in BUGGY)
    new_codes = DIAGNOSES_ADDED_FOR_09
    assert all(codes[code] > 0 for code in new_codes), [code for code in new_codes if not codes[code]]
    specific = sum(n for code, n in codes.items() if code != "mismatch")
    assert specific / len(BUGGY) >= 0.9
    assert len({a.id for a in BUGGY + CORRECT}) == len(BUGGY + CORRECT), "attempt names are unique"


DIAGNOSES_ADDED_FOR_09 = ("rope_layout", "rope_rotation", "rope_frequencies", "rope_positions", "rope_axes",
                          "rope_missing", "rotated_values", "epsilon", "norm_weight", "norm_statistic", "gating",
                          "kv_grouping", "kv_cache")


def test_every_new_code_is_a_diagnosis_and_every_hypothesis_uses_one():
    assert set(DIAGNOSES_ADDED_FOR_09) <= set(checks.DIAGNOSES)
    hypotheses = _gqa_variants.FULL_PASS + _gqa_variants.CACHED + _gqa_variants.ROTARY
    assert all(isinstance(h, Mistake) and h.code in checks.DIAGNOSES for h in hypotheses)


@pytest.fixture
def one_thread():
    """As inside a check: on tensors this small a thread pool costs more than it saves."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_every_hypothesised_gqa_mistake_changes_the_output(one_thread):
    """A hypothesis equal to the right answer could never be told apart: each must differ somewhere."""
    g = notebook09
    generator = torch.Generator().manual_seed(0)
    setups = [g._build(modern.GroupedQueryAttention, kv, theta, extra, generator).setup
              for kv, theta, extra in g.CONFIGS + g.OPTIONAL]
    x = torch.randn(2, g.PLAN_TOKENS, g.EMBED_DIM, generator=generator)
    def differs(setup, plan, spec, cached):
        # a mistake that runs past the tables (an offset counted twice) is compared on the calls before that
        for calls in range(len(plan), 0, -1):
            tokens = sum(length for _, length in plan[:calls])
            try:
                wrong = _gqa_variants.simulate(setup, x[:, :tokens], plan[:calls], spec, cached=cached)
            except RuntimeError:
                continue
            right = _gqa_variants.simulate(setup, x[:, :tokens], plan[:calls], {}, cached=cached)
            return not torch.allclose(wrong, right, atol=1e-3)
        return False

    for mistakes, plan, cached in ((_gqa_variants.FULL_PASS, [(0, g.PLAN_TOKENS)], False),
                                   (_gqa_variants.CACHED, list(g.PLAN), True)):
        for mistake in mistakes:
            assert any(differs(s, plan, mistake.spec, cached) for s in setups), mistake.message


# ---------------------------------------------------------------- a checker never raises

def _raises_value_error(*args, **kwargs):
    raise ValueError("operands could not be broadcast together")


def _not_written(*args, **kwargs):
    raise NotImplementedError("Exercise: write it")


class _NotAModule:
    def __init__(self, *args, **kwargs):
        pass


class _RaisingModule(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()
        raise NotImplementedError("Exercise: write it")


ODD_FUNCTIONS = [
    ("returns_none", lambda *args, **kwargs: None, {"shape", "dtype"}),
    ("returns_string", lambda *args, **kwargs: "tokens", {"dtype", "shape"}),
    ("returns_scalar_tensor", lambda *args, **kwargs: torch.tensor(0.5), {"shape", "dtype"}),
    ("returns_wrong_shape", lambda *args, **kwargs: torch.zeros(2, 3), {"shape"}),
    ("raises_value_error", _raises_value_error, {"exception"}),
    ("not_callable", 42, {"exception"}),
    ("none", None, {"exception"}),
    ("a_string", "rope", {"exception"}),
]


@pytest.mark.parametrize("exercise", sorted(CHECKERS))
@pytest.mark.parametrize("name,candidate,codes", ODD_FUNCTIONS, ids=[c[0] for c in ODD_FUNCTIONS])
def test_checker_never_raises(exercise, name, candidate, codes):
    result = run(exercise, candidate)
    assert isinstance(result, verdict.CheckResult) and not result.passed
    assert result.diagnosis != "checker_error", result
    if exercise in CLASS_EXERCISES and callable(candidate):
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


@pytest.mark.parametrize("exercise,instance", [
    ("9.3", lambda: modern.RMSNorm(16)),
    ("9.4", lambda: modern.SwiGLU(16, 40)),
    ("9.6", lambda: modern.GroupedQueryAttention(32, 4, 2, 10)),
], ids=["9.3", "9.4", "9.6"])
def test_an_instance_is_refused_and_left_as_it_was(exercise, instance):
    module = instance().train()
    weights = [p.detach().clone() for p in module.parameters()]
    result = run(exercise, module)
    assert result.diagnosis == "exception" and "pass the class itself" in result.message, result
    assert module.training
    assert all(torch.equal(before, after) for before, after in zip(weights, module.parameters()))


def _wrong_shape_gqa_forward(self, x, cache=None):
    return x[:, :, :4]


def test_a_class_with_wrong_parameters_or_outputs_gets_a_verdict(unguarded):
    class NoBiasFree(modern.GroupedQueryAttention):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.key = torch.nn.Linear(self.embed_dim, self.num_kv_heads * self.head_dim)   # with a bias

    class WrongShape(modern.GroupedQueryAttention):
        forward = _wrong_shape_gqa_forward

    renamed = run("9.6", NoBiasFree)
    assert renamed.diagnosis == "mismatch" and "key.bias" in renamed.message, renamed
    assert run("9.6", WrongShape).diagnosis == "shape"


# ---------------------------------------------------------------- the student's state

def _state():
    return (torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_num_threads(),
            torch.get_rng_state().clone(), random.getstate(), np.random.get_state()[1].copy())


@pytest.mark.parametrize("exercise", sorted(CHECKERS))
def test_checks_leave_global_state_alone(exercise):
    by_exercise = {a.exercise: a for a in BUGGY}
    torch.manual_seed(123)
    before = _state()
    for candidate in (REFERENCES[exercise], by_exercise[exercise].candidate):
        run(exercise, candidate)
    after = _state()
    assert before[:3] == after[:3]
    assert torch.equal(before[3], after[3]) and before[4] == after[4] and (before[5] == after[5]).all()


def test_a_float64_notebook_is_respected():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for exercise in CHECKERS:
            assert run(exercise, REFERENCES[exercise]).passed, exercise
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(previous)


def test_grad_mode_is_restored():
    with torch.no_grad():
        assert run("9.6", modern.GroupedQueryAttention).passed
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()


_PATCHABLE = [("9.1", "rope_tables"), ("9.2", "apply_rotary"), ("9.5", "repeat_kv")]


@pytest.mark.parametrize("exercise,name", _PATCHABLE, ids=[e for e, _ in _PATCHABLE])
def test_patching_the_reference_to_the_wrong_answer_changes_nothing(exercise, name, monkeypatch):
    wrong = next(a for a in BUGGY if a.exercise == exercise and callable(a.candidate)
                 and a.expected not in ("not_implemented", "exception"))
    honest = run(exercise, wrong.candidate)
    module = importlib.import_module("course_lib.modern")
    monkeypatch.setattr(module, name, wrong.candidate)
    patched = run(exercise, wrong.candidate)
    assert not patched.passed and patched.diagnosis == honest.diagnosis, (wrong.id, patched)
    assert getattr(module, name) is wrong.candidate


def test_a_patched_reference_class_is_set_aside(monkeypatch):
    by_id = {a.id: a for a in BUGGY}
    wrong = by_id["9.6-GQARepeatNotInterleave"].candidate
    monkeypatch.setattr(modern.GroupedQueryAttention, "forward", wrong.forward)   # the reference agrees now
    result = run("9.6", wrong)
    assert result.diagnosis == "kv_grouping", result
    assert modern.GroupedQueryAttention.forward is wrong.forward


# ---------------------------------------------------------------- messages, hints, solutions

def test_the_theta_default_note_only_when_the_default_is_wrong():
    by_id = {a.id: a for a in BUGGY}
    wrong_default = run("9.1", by_id["9.1-rope_default_theta_1000"].candidate)
    right_default = run("9.1", by_id["9.1-rope_exp_without_log"].candidate)
    assert "left theta at its default" in wrong_default.message, wrong_default
    assert right_default.diagnosis == "rope_frequencies", right_default
    assert "left theta at its default" not in right_default.message, right_default


def test_gqa_success_says_what_was_checked():
    message = run("9.6", modern.GroupedQueryAttention).message
    assert "multi-query" in message and "KV cache" in message and "qk_norm" in message
    plain = next(a for a in CORRECT if a.name == "GQAPlainConstructor").candidate
    assert "qk_norm" not in run("9.6", plain).message


def test_a_helper_that_fails_its_own_check_is_named_only_when_it_is_wrong():
    by_id = {a.id: a for a in BUGGY}
    own = run("9.6", by_id["9.6-GQARopeOnQueriesOnly"].candidate)   # the reference helpers: no note
    assert own.diagnosis == "rope_missing" and "exercise 9.2" not in own.message


@pytest.mark.parametrize("exercise", sorted(CHECKERS))
def test_hints_are_registered(exercise):
    entry, state = exercises.exercise(exercise), _core.hint_state(exercise)
    state.shown = 0
    assert 2 <= len(entry.hints) <= 3
    texts = [checks.hint(exercise) for _ in range(len(entry.hints) + 1)]
    assert texts[0].startswith(f"Hint 1/{len(entry.hints)} for exercise {exercise}")
    assert texts[-1] == texts[-2]
    state.shown = 0


@pytest.mark.parametrize("exercise", sorted(CHECKERS))
def test_solutions_come_from_notebook_09(exercise, capsys):
    source = checks.show_solution(exercise, force=True)
    assert source.startswith(f"# Solution of exercise {exercise} (") and "SOLUTION" not in source
    assert "def " in source or "class " in source


def test_the_gqa_check_frees_no_module_it_built_before_it_ends(tmp_path):
    """A module the check builds is never freed while the check still builds others: CPython gives a freed object's
    id to the next one, so a wrong module that keeps its tokens in a global keyed by id(self) would otherwise hand its
    count to the 'fresh' module the check compares it with, and its verdict would depend on memory reuse."""
    from bank.search34q_bugs import GQAStartFromCacheEachCall

    log = tmp_path / "events"    # the check runs in a child process: it writes what happened here
    log.write_text("")

    def note(event):
        with log.open("a") as file:
            file.write(event + "\n")

    class Tracked(GQAStartFromCacheEachCall):
        def __init__(self, embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta=10000.0):
            super().__init__(embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta)
            note("built")
            weakref.finalize(self, note, "freed")

    result = run("9.6", Tracked)
    assert result.passed, result.message
    events = log.read_text().split()
    last_built = max(i for i, event in enumerate(events) if event == "built")
    assert events.count("built") >= 5
    assert "freed" not in events[:last_built], events
