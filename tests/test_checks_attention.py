"""The attention checkers (exercises 1.1-3.3) against the reference and a bank of student attempts."""
from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from bank.attention_bugs import BUGGY, CORRECT

from course_lib import attention
from course_lib.classroom import checks, exercises, verdict
from course_lib.classroom.checks import _core, notebook01, notebook02, notebook03
from course_lib.classroom.checks._attn_hypotheses import (
    MODULE_HYPOTHESES,
    SDPA_HYPOTHESES,
    module_variant,
    sdpa_variant,
)
from course_lib.classroom.checks._attn_modules import EMBED_DIM, MAX_TOKENS, random_params
from course_lib.classroom.checks._student_code import load_parameters as load
from course_lib.classroom.checks._student_code import module_output

CHECKERS = {
    "1.1": lambda candidate: checks.check_toy_prediction(*candidate),
    "1.2": checks.check_toy_attention,
    "1.3": checks.check_scaled_dot_product_attention,
    "2.1": checks.check_causal_mask,
    "2.2": checks.check_masked_attention,
    "3.1": checks.check_split_heads,
    "3.2": checks.check_merge_heads,
    "3.3": checks.check_multi_head_attention,
}

REFERENCES = {
    "1.1": (torch.softmax(attention.TOY_KEYS @ torch.tensor([0.0, 1.0]), dim=0),
            attention.toy_attention(torch.tensor([0.0, 1.0]), attention.TOY_KEYS, attention.TOY_VALUES)),
    "1.2": attention.toy_attention,
    "1.3": attention.scaled_dot_product_attention,
    "2.1": attention.causal_mask,
    "2.2": attention.MaskedAttention,
    "3.1": attention.split_heads,
    "3.2": attention.merge_heads,
    "3.3": attention.MultiHeadMaskedAttention,
}


def run(exercise, candidate):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # students' code may warn (implicit softmax dim, ...)
        return CHECKERS[exercise](candidate)


# ---------------------------------------------------------------- reference and bank

@pytest.mark.parametrize("exercise", sorted(CHECKERS))
def test_reference_passes(exercise):
    result = run(exercise, REFERENCES[exercise])
    assert result.passed, result.message
    assert result.diagnosis is None and result.exercise == exercise


def test_bank_size_and_coverage():
    assert len(BUGGY) >= 40 and len(CORRECT) >= 12
    exercises = {a.exercise for a in BUGGY} | {a.exercise for a in CORRECT}
    assert exercises == set(CHECKERS)
    codes = Counter(a.expected for a in BUGGY)
    for code in ("not_implemented", "exception", "shape", "dtype", "nan", "softmax_dim", "scale",
                 "normalization", "causal_mask", "head_split", "dropout", "mismatch",
                 "mutation", "values", "batch_mixing", "precision", "gradient"):   # issues 11 and 20
        assert codes[code] > 0, code
    gradient = {a.exercise for a in BUGGY if a.expected == "gradient"}
    assert {"1.2", "1.3", "2.2", "3.1", "3.2", "3.3"} <= gradient, "every differentiable checker meets a cut graph"
    specific = sum(n for code, n in codes.items() if code != "mismatch")
    assert specific / len(BUGGY) >= 0.9
    for exercise in ("2.2", "3.3"):   # both module exercises show every module mistake
        module_codes = {a.expected for a in BUGGY if a.exercise == exercise}
        assert {"softmax_dim", "scale", "causal_mask", "normalization", "dropout", "shape"} <= module_codes


def test_hypotheses_without_mistakes_are_the_reference():
    gen = torch.Generator().manual_seed(0)
    params = random_params(gen)
    for heads in (1, 2, 4):
        model = attention.MultiHeadMaskedAttention(EMBED_DIM, heads, MAX_TOKENS).eval()
        load(model, params)
        x = torch.randn(2, MAX_TOKENS - 2, EMBED_DIM, generator=gen)
        with torch.no_grad():
            assert torch.allclose(module_variant(x, params, heads, {}), model(x), atol=1e-5)
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 2)
    mask = torch.rand(3, 5, generator=gen) < 0.7
    mask[:, 0] = True
    assert torch.allclose(sdpa_variant(q, k, v, mask, {}), attention.scaled_dot_product_attention(q, k, v, mask),
                          atol=1e-6)
    # every mistake we fit against really changes the output
    for hypothesis in SDPA_HYPOTHESES:   # with the mask or without one (a causal mask where none is given)
        assert any(not torch.allclose(sdpa_variant(q, k, v, given, hypothesis.spec),
                                      attention.scaled_dot_product_attention(q, k, v, given), equal_nan=True)
                   for given in (mask, None)), hypothesis.spec
    x = torch.randn(2, MAX_TOKENS, EMBED_DIM, generator=gen)
    reference = module_variant(x, params, 2, {})
    for hypothesis in MODULE_HYPOTHESES:
        assert not torch.allclose(module_variant(x, params, 2, hypothesis.spec), reference, equal_nan=True), \
            hypothesis.spec


# ---------------------------------------------------------------- a checker never raises

def _raises_type_error(*args, **kwargs):
    raise TypeError("unsupported operand type(s) for @: 'list' and 'Tensor'")


class _NotAModule:
    def __init__(self, *args):
        pass


ODD_CANDIDATES = [
    ("returns_none", lambda *args, **kwargs: None, {"shape"}),
    ("returns_list", lambda *args, **kwargs: [1.0, 2.0], {"dtype"}),
    ("returns_string", lambda *args, **kwargs: "attention", {"dtype"}),
    ("returns_int_tensor", lambda *args, **kwargs: torch.zeros(3, dtype=torch.long), {"shape", "dtype"}),
    ("raises_type_error", _raises_type_error, {"exception"}),
    ("not_callable", 42, {"exception"}),
]


@pytest.mark.parametrize("exercise", sorted(set(CHECKERS) - {"1.1"}))
@pytest.mark.parametrize("name,candidate,codes", ODD_CANDIDATES, ids=[c[0] for c in ODD_CANDIDATES])
def test_checker_never_raises(exercise, name, candidate, codes):
    result = run(exercise, candidate)
    assert isinstance(result, verdict.CheckResult) and not result.passed
    if exercise in ("2.2", "3.3"):
        # a function is not a class: calling it "constructs" something that is not an nn.Module
        assert result.diagnosis == "exception", result
    else:
        assert result.diagnosis in codes, result


@pytest.mark.parametrize("exercise", sorted(set(CHECKERS) - {"1.1"}))
def test_not_implemented_is_polite(exercise):
    def not_written(*args, **kwargs):
        raise NotImplementedError(f"Exercise {exercise}: write it")
    result = run(exercise, not_written)
    assert result.diagnosis == "not_implemented"
    assert f"Exercise {exercise}" in result.message and "NotImplementedError" in result.message


def test_module_checkers_report_classes_that_are_not_modules():
    for exercise in ("2.2", "3.3"):
        result = run(exercise, _NotAModule)
        assert result.diagnosis == "exception" and "nn.Module" in result.message
    instance = run("2.2", attention.MaskedAttention(EMBED_DIM, MAX_TOKENS))
    assert instance.diagnosis == "exception" and "pass the class itself" in instance.message


def test_passing_a_result_instead_of_the_function():
    result = run("2.1", attention.causal_mask(4))
    assert result.diagnosis == "exception" and "not the result of calling it" in result.message


def test_toy_prediction_odd_inputs():
    assert checks.check_toy_prediction(object(), 2.0).diagnosis == "dtype"
    assert checks.check_toy_prediction([0.21, 0.58, 0.21], [1.0, 2.0]).diagnosis == "shape"
    assert checks.check_toy_prediction([0.21, 0.58, 0.21], None).diagnosis == "not_implemented"


# ---------------------------------------------------------------- messages, hints, solutions

def test_messages_name_the_mistake():
    by_id = {a.id: a for a in BUGGY}
    softmax = run("1.3", by_id["1.3-sdpa_softmax_queries"].candidate)
    assert "columns" in softmax.message and "keys" in softmax.message
    sliced = run("2.2", by_id["2.2-MaskedFullMask"].candidate)
    assert "max_tokens" in sliced.message and "current sequence length" in sliced.message
    renamed = run("2.2", by_id["2.2-MaskedRenamed"].candidate)
    assert "query.weight" in renamed.message and "W_q.weight" in renamed.message
    leak = run("3.3", by_id["3.3-MultiNoMask"].candidate)
    assert "future" in leak.message.lower()
    corner = run("2.2", by_id["2.2-MaskedWrongCorner"].candidate)
    assert "shorter" in corner.message and "current sequence length" in corner.message
    view = run("3.2", by_id["3.2-merge_view_after_transpose"].candidate)
    assert "contiguous" in view.message


def test_parameter_names_and_shapes_are_checked_before_any_output(unguarded):
    """A module built with a bias, or with a projection of the wrong size, is told so by name and shape."""
    class WithBias(attention.MaskedAttention):
        def __init__(self, embed_dim, max_tokens, dropout_rate):
            super().__init__(embed_dim, max_tokens, dropout_rate)
            self.query = torch.nn.Linear(embed_dim, embed_dim)               # bias=True by default

    class Wide(attention.MaskedAttention):
        def __init__(self, embed_dim, max_tokens, dropout_rate):
            super().__init__(embed_dim, max_tokens, dropout_rate)
            self.value = torch.nn.Linear(embed_dim, 2 * embed_dim, bias=False)

    bias = run("2.2", WithBias)
    assert bias.diagnosis == "shape" and "query.bias" in bias.message and "bias=False" in bias.message, bias
    wide = run("2.2", Wide)
    assert wide.diagnosis == "shape", wide
    assert "value.weight" in wide.message and f"({2 * EMBED_DIM}, {EMBED_DIM})" in wide.message, wide


def test_a_probe_gives_the_module_its_weights_and_mode_back():
    """module_output(params=..., train_seed=...) runs the student's module with other weights in training
    mode, and leaves it as it was afterwards, also when the student's forward raises."""
    class Recording(torch.nn.Linear):
        modes: list[bool] = []

        def forward(self, x):
            self.modes.append(self.training)
            if x.shape[0] == 3:
                raise ValueError("the student's bug")
            return super().forward(x)

    model = Recording(4, 4, bias=False).eval()
    own = model.weight.detach().clone()
    x = torch.randn(2, 5, 4)
    out = module_output(model, x, "Recording.forward(x)", params={"weight": torch.eye(4)}, train_seed=7)
    assert torch.equal(out, x) and Recording.modes == [True]       # identity weights, in training mode
    assert torch.equal(model.weight, own) and not model.training
    with pytest.raises(verdict.Failure):
        module_output(model, torch.randn(3, 5, 4), "Recording.forward(x)", params={"weight": torch.eye(4)},
                      train_seed=7)
    assert torch.equal(model.weight, own) and not model.training


def test_result_renders():
    good = run("2.1", attention.causal_mask)
    bad = run("2.1", next(a.candidate for a in BUGGY if a.id == "2.1-mask_triu"))
    assert "PASSED" in str(good) and "NOT YET (causal_mask)" in str(bad)
    assert "Passed" in good._repr_html_() and "<code>causal_mask</code>" in bad._repr_html_()
    assert "diagnosis='causal_mask'" in repr(bad) and bool(good) and not bool(bad)


@pytest.mark.parametrize("exercise", ["1.1", "1.2", "1.3", "2.1", "2.2", "3.1", "3.2", "3.3"])
def test_hints_progress_and_stop_at_the_last(exercise, capsys):
    entry, state = exercises.exercise(exercise), _core.hint_state(exercise)
    state.shown = 0
    assert 2 <= len(entry.hints) <= 3
    texts = [checks.hint(exercise) for _ in range(len(entry.hints) + 1)]
    for level, text in enumerate(texts[:-1]):
        assert text.startswith(f"Hint {level + 1}/{len(entry.hints)} for exercise {exercise}")
    assert texts[-1] == texts[-2]   # after the last hint it repeats the last one
    assert "Hint 1/" in capsys.readouterr().out
    state.shown = 0


@pytest.mark.parametrize("exercise,name", [("1.2", "def toy_attention"), ("1.3", "def scaled_dot_product_attention"),
                                           ("2.1", "def causal_mask"), ("2.2", "def forward"),
                                           ("3.1", "def split_heads"), ("3.2", "def merge_heads"),
                                           ("3.3", "class MultiHeadMaskedAttention")])
def test_show_solution_prints_the_reference(exercise, name, capsys):
    source = checks.show_solution(exercise, force=True)
    assert name in source and name in capsys.readouterr().out


ATTENTION_CHECKERS = notebook01.__all__ + notebook02.__all__ + notebook03.__all__


def test_exports():
    assert set(ATTENTION_CHECKERS) <= set(dir(checks))
    assert all(callable(getattr(checks, name)) for name in ATTENTION_CHECKERS)
    assert all(getattr(checks, name).exercise for name in ATTENTION_CHECKERS)


def test_each_checker_lives_in_the_module_of_its_notebook():
    # exercise X.Y is found in checks/notebook0X.py: checker, hints and registration together
    names = [name for name in dir(checks) if name.startswith("check_")]
    assert len(names) >= 20
    for name in names:
        fn = getattr(checks, name)
        notebook = f"{int(fn.exercise.split('.')[0]):02d}"
        assert fn.__module__ == f"course_lib.classroom.checks.notebook{notebook}", (name, fn.__module__)
        assert exercises.exercise(fn.exercise).notebook == notebook and exercises.exercise(fn.exercise).checker == name
