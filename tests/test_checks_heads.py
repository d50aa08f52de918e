"""The checkers of notebook 11 (exercises 11.1-11.3) against the references and a bank of student attempts."""
from __future__ import annotations

import random
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from bank.heads_bugs import BUGGY, CORRECT

from course_lib import heads
from course_lib.classroom import checks, exercises, verdict
from course_lib.classroom.checks import _core, _heads_ablation, _heads_scores
from course_lib.classroom.checks.engine import model_state

CHECKERS = {
    "11.1": checks.check_previous_token_score,
    "11.2": checks.check_induction_score,
    "11.3": checks.check_ablate_head,
}

REFERENCES = {"11.1": heads.previous_token_score, "11.2": heads.induction_score, "11.3": heads.ablate_head}

# The mistakes the issue names, each with the diagnosis a bank attempt must get for it.
ISSUE_MISTAKES = {
    "previous-token: the wrong diagonal offset": ("11.1", "score_offset"),
    "previous-token: the first position included": ("11.1", "score_positions"),
    "previous-token: averaged over the wrong axis": ("11.1", "score_axes"),
    "induction: the offset by one (the copy itself)": ("11.2", "score_offset"),
    "induction: first-half positions included": ("11.2", "score_positions"),
    "induction: the batch and head axes swapped": ("11.2", "score_axes"),
    "ablation: zeroing the weights instead of the head's output": ("11.3", "ablation_method"),
    "ablation: not restoring the model": ("11.3", "not_restored"),
    "ablation: the wrong slice of the merged heads": ("11.3", "ablation_slice"),
}

DIAGNOSES_ADDED_FOR_11 = ("score_offset", "score_positions", "score_axes", "ablation_method",
                          "ablation_slice", "not_restored")


def run(exercise, candidate):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CHECKERS[exercise](candidate)


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
    assert all(codes[code] > 0 for code in DIAGNOSES_ADDED_FOR_11), codes
    assert codes["mismatch"] == 0
    assert len({a.id for a in BUGGY + CORRECT}) == len(BUGGY + CORRECT), "attempt names are unique"


def test_every_new_code_is_a_diagnosis_and_every_mistake_uses_one():
    assert set(DIAGNOSES_ADDED_FOR_11) <= set(checks.DIAGNOSES)
    named = list(_heads_ablation.ABLATION_MISTAKES) + list(_heads_scores.PREVIOUS_MISTAKES) \
        + list(_heads_scores.INDUCTION_MISTAKES)
    assert all(m.code in checks.DIAGNOSES for m in named)


def test_every_score_mistake_changes_the_score():
    """On causal weights of two lengths (for the induction score: two copies, and a shorter second half), each
    slip, hand-written or from the grid, gives another score than the right one."""
    generator = torch.Generator().manual_seed(0)
    future = torch.ones(10, 10, dtype=torch.bool).triu(1)
    weights = torch.rand(3, 4, 10, 10, generator=generator).masked_fill(future, float("-inf")).softmax(-1)
    for half, mistakes in ((None, _heads_scores.PREVIOUS_MISTAKES), (5, _heads_scores.INDUCTION_MISTAKES)):
        lengths = (10, 9)
        rights = [_heads_scores.variant(weights[..., :n, :n], half, spec={}) for n in lengths]
        for n, right in zip(lengths, rights):
            sub = weights[..., :n, :n]
            assert torch.allclose(right, heads.previous_token_score(sub) if half is None
                                  else heads.induction_score(sub, half))
        assert len(mistakes) > 20   # the grid is there: slips of one or two places, wrapped or not, each divisor
        for mistake in mistakes:
            wrongs = [_heads_scores.variant(weights[..., :n, :n], half, spec=mistake.spec) for n in lengths]
            assert any(w.shape != r.shape or not torch.allclose(w, r) for w, r in zip(wrongs, rights)), mistake


def test_every_ablation_mistake_changes_the_output():
    for _, model in _heads_ablation._models():
        idx = torch.randint(13, (2, 10), generator=torch.Generator().manual_seed(1))
        with torch.no_grad(), heads.ablate_head(model, 1, 1):
            right = model(idx)
        for mistake in _heads_ablation.ABLATION_MISTAKES:
            if mistake.spec.get("kind") in ("value_weight", "layer_next"):
                continue   # same as right without a value bias / past the last layer
            try:
                wrong = _heads_ablation._mistaken(model, 1, 1, idx, mistake.spec)
            except ValueError:   # a slip that does not apply to these sizes (no such position)
                continue
            assert not torch.allclose(wrong, right, atol=1e-4), mistake.spec


_ODD = [
    ("returns_none", lambda *a, **k: None, {"shape", "exception"}),
    ("returns_float", lambda *a, **k: 0.5, {"dtype", "exception"}),
    ("raises", lambda *a, **k: 1 / 0, {"exception"}),
    ("not_callable", 42, {"exception"}),
    ("a_string", "score", {"exception"}),
]


@pytest.mark.parametrize("exercise", sorted(CHECKERS))
@pytest.mark.parametrize("name,candidate,codes", _ODD, ids=[c[0] for c in _ODD])
def test_checker_never_raises(exercise, name, candidate, codes):
    result = run(exercise, candidate)
    assert isinstance(result, verdict.CheckResult) and not result.passed
    assert result.diagnosis in codes, result


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
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("exercise", sorted(CHECKERS))
def test_hints_are_registered(exercise):
    entry, state = exercises.exercise(exercise), _core.hint_state(exercise)
    state.shown = 0
    assert 2 <= len(entry.hints) <= 3
    texts = [checks.hint(exercise) for _ in range(len(entry.hints) + 1)]
    assert texts[0].startswith(f"Hint 1/{len(entry.hints)} for exercise {exercise}")
    state.shown = 0


@pytest.mark.parametrize("exercise", sorted(CHECKERS))
def test_solutions_come_from_notebook_11(exercise):
    source = checks.show_solution(exercise, force=True)
    assert source.startswith(f"# Solution of exercise {exercise} (") and "SOLUTION" not in source


# ---------------------------------------------------------------- the engine's model_state probe

def _tiny_model():
    torch.manual_seed(0)
    model = heads.AttentionOnly(heads.InductionConfig(vocab_size=7, half=3, embed_dim=8, num_heads=2, num_layers=2,
                                                      min_period=2)).eval()
    planted = model_state.plant_hooks(model, [model.blocks[0].attn.proj])
    return model, planted


def _set_grad_off(model):
    torch.set_grad_enabled(False)


def _replace_weight(model):
    model.head.weight = torch.nn.Parameter(model.head.weight.detach().clone())


def _global_hook(model):
    return torch.nn.modules.module.register_module_forward_pre_hook(lambda module, inputs: None)


# What a context manager can leave changed, and the words the probe must name it by.
_CHANGES = [
    ("others_hook_cleared", lambda m: m.blocks[0].attn.proj._forward_pre_hooks.clear(), "other code registered"),
    ("hook_left", lambda m: m.ln_f.register_forward_hook(lambda *a: None), "ln_f still has a forward hook"),
    ("eval_to_train", lambda m: m.train(), "left in training mode"),
    ("one_submodule_mode", lambda m: m.blocks[1].attn.train(), "blocks.1.attn was left in training mode"),
    ("frozen", lambda m: m.head.weight.requires_grad_(False), "head.weight has requires_grad=False"),
    ("to_float64", lambda m: m.double(), "float64"),
    ("values", lambda m: m.head.weight.data.mul_(0), "head.weight holds other numbers"),
    ("replaced_weight", _replace_weight, "no longer the same tensor object"),
    ("patched_forward", lambda m: setattr(m.blocks[0].attn.proj, "forward", lambda x: x), "forward"),
    ("module_replaced", lambda m: setattr(m, "ln_f", torch.nn.Identity()), "ln_f was replaced"),
    ("new_buffer", lambda m: m.register_buffer("extra", torch.zeros(1)), "extra is a new buffer"),
    ("attribute", lambda m: setattr(m.blocks[0].attn, "num_heads", 1), "num_heads was changed from 2 to 1"),
    ("tensor_hook", lambda m: m.head.weight.register_hook(lambda g: g), "the tensor head.weight"),
    ("grad_mode", _set_grad_off, "grad mode is off"),
    ("global_hook", _global_hook, "torch still has a global forward pre"),
]


@pytest.mark.parametrize("name,change,words", _CHANGES, ids=[c[0] for c in _CHANGES])
def test_model_state_names_what_changed(name, change, words):
    model, planted = _tiny_model()
    before = model_state.ModelState.of(model, planted)
    assert before.changes(model) == []
    grad_mode = torch.is_grad_enabled()
    handle = None
    try:
        handle = change(model)
        found = before.first_changes(model)
    finally:
        torch.set_grad_enabled(grad_mode)
        if handle is not None and hasattr(handle, "remove"):
            handle.remove()
    assert found is not None and words in found, found


def test_model_state_sees_nothing_when_everything_is_undone():
    """A hook registered and removed (with kwargs too), a forward, a mode switched and switched back, values
    changed and copied back: the model is as it was."""
    model, planted = _tiny_model()
    before = model_state.ModelState.of(model, planted)
    idx = torch.randint(7, (2, 6))
    handles = [model.blocks[0].attn.proj.register_forward_pre_hook(lambda m, a, k: (a, k), with_kwargs=True),
               model.register_forward_hook(lambda *a: None, always_call=True)]
    model.train()
    saved = model.head.weight.detach().clone()
    with torch.no_grad():
        model.head.weight.zero_()
    model(idx).sum().backward()
    for handle in handles:
        handle.remove()
    model.eval()
    with torch.no_grad():
        model.head.weight.copy_(saved)
    for p in model.parameters():
        p.grad = None
    assert before.changes(model) == []


def test_autograd_cause_names_the_students_state():
    model, planted = _tiny_model()
    before = model_state.ModelState.of(model, planted)
    with torch.no_grad():
        assert model_state.autograd_cause(None, before)[0] == "gradient"
        assert "grad mode was off" in model_state.autograd_cause(None, before)[1]
    model.head.weight.requires_grad_(False)
    code, why = model_state.autograd_cause(None, before)
    assert code == "gradient" and "head.weight" in why and "requires_grad" in why
    model.head.weight.requires_grad_(True)
    x = torch.ones(3, requires_grad=True)
    y = x.exp()
    y.mul_(2)                                  # exp saved its output: the backward must fail
    with pytest.raises(RuntimeError) as raised:
        y.sum().backward()
    assert model_state.autograd_cause(raised.value, before)[0] == "mutation"


def test_an_ablation_that_clears_other_codes_hooks_is_not_restored():
    """The check plants hooks of someone else on the model before calling the student's context manager."""
    import contextlib

    @contextlib.contextmanager
    def clears(model, layer, head):
        attn = model.blocks[layer].attn
        size = attn.head_dim
        attn.proj.register_forward_pre_hook(
            lambda module, inputs: (inputs[0].index_fill(-1, torch.arange(head * size, (head + 1) * size), 0.0),))
        try:
            yield model
        finally:
            attn.proj._forward_pre_hooks.clear()

    result = run("11.3", clears)
    assert result.diagnosis == "not_restored" and "other code registered" in result.message, result


def test_global_module_hooks_are_put_back_after_a_check():
    before = dict(torch.nn.modules.module._global_forward_pre_hooks)
    with model_state.global_hooks_kept():
        torch.nn.modules.module.register_module_forward_pre_hook(lambda module, inputs: None)
        assert len(torch.nn.modules.module._global_forward_pre_hooks) == len(before) + 1
    assert dict(torch.nn.modules.module._global_forward_pre_hooks) == before


def test_model_state_survives_attributes_that_cannot_be_compared():
    model, planted = _tiny_model()
    model.blocks[0].pair = (torch.zeros(2), torch.ones(2))   # a tuple of tensors: == cannot answer
    before = model_state.ModelState.of(model, planted)
    assert before.changes(model) == []
    model.blocks[0].pair = (torch.zeros(2), torch.zeros(2))
    assert "blocks.0.pair was changed" in before.first_changes(model)
