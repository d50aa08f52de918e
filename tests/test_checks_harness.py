"""The checkers' harness against hostile or broken code: patched references, leaked state,
endless loops, sys.exit, Ctrl-C, inputs changed in place, and the checker's own bugs."""
from __future__ import annotations

import functools
import inspect
import math
import operator
import os
import random
import sys
import tempfile
import time

import numpy as np
import pytest
import torch

import course_lib
import course_lib.attention as attention
from course_lib.classroom import checks, verdict
from course_lib.classroom.checks import _gradients as gradients
from course_lib.classroom.checks import notebook01
from course_lib.classroom.checks.engine import run


def _wrong_mask(n):
    return torch.ones(n, n, dtype=torch.bool).triu()   # the classic transposed mask


# ---------------------------------------------------------------- references bound privately

def test_a_patched_reference_cannot_make_a_wrong_answer_pass(monkeypatch):
    monkeypatch.setattr(attention, "causal_mask", _wrong_mask)
    result = checks.check_causal_mask(_wrong_mask)
    assert not result.passed and result.diagnosis == "causal_mask", result
    assert attention.causal_mask is _wrong_mask   # the student's patch is back after the check


def test_a_reference_rebound_before_the_first_check_is_still_guarded(monkeypatch):
    # a notebook rebinds the course's name to its own function before checking that exercise at all: the guard
    # still watches the course's own, which the student may call by another name
    original = attention.causal_mask
    run.reference_of.cache_clear()
    monkeypatch.setattr(attention, "causal_mask", _wrong_mask)
    assert checks.check_causal_mask(_wrong_mask).diagnosis == "causal_mask"
    result = checks.check_causal_mask(lambda n: original(n))
    assert (result.passed, result.diagnosis) == (False, "calls_reference"), result
    assert run.reference_of("2.1") is original


def test_a_patched_reference_cannot_make_a_right_answer_fail(monkeypatch):
    original = attention.causal_mask
    monkeypatch.setattr(attention, "causal_mask", _wrong_mask)
    monkeypatch.setattr(attention, "scaled_dot_product_attention", lambda q, k, v, mask=None: v)
    assert checks.check_causal_mask(original).passed
    assert checks.check_masked_attention(attention.MaskedAttention).passed


def test_a_patched_reference_method_is_set_aside(monkeypatch):
    def forward(self, x, *args, **kwargs):
        return self.proj(x)   # forgets attention altogether

    class Attention(attention.MultiHeadMaskedAttention):
        pass
    Attention.forward = forward
    monkeypatch.setattr(attention.MultiHeadMaskedAttention, "forward", forward)   # the reference agrees now
    result = checks.check_multi_head_attention(Attention)
    assert not result.passed, result
    assert attention.MultiHeadMaskedAttention.forward is forward   # the student's patch is back


# ---------------------------------------------------------------- state left as found

def _state():
    return (torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_num_threads(),
            torch.get_rng_state().clone(), random.getstate(), np.random.get_state()[1].copy(),
            dict(vars(attention)))


def _meddling_mask(n):
    torch.set_num_threads(3)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    attention.causal_mask = _wrong_mask
    attention.SOMETHING_NEW = 1
    return torch.ones(n, n, dtype=torch.bool).tril()


def test_a_check_leaves_the_kernel_as_it_found_it():
    torch.set_num_threads(1)
    before = _state()
    result = checks.check_causal_mask(_meddling_mask)
    after = _state()
    assert result.passed, result
    assert before[:3] == after[:3]
    assert torch.equal(before[3], after[3]) and before[4] == after[4] and (before[5] == after[5]).all()
    assert before[6] == after[6] and not hasattr(attention, "SOMETHING_NEW")
    assert checks.check_causal_mask(attention.causal_mask).passed   # and later correct code still passes


def test_a_default_dtype_or_grad_mode_left_changed_is_named_and_put_back():
    before = _state()

    def leaves_settings_changed(n):
        torch.set_grad_enabled(False)
        torch.set_default_dtype(torch.float64)
        return torch.ones(n, n, dtype=torch.bool).tril()
    result = checks.check_causal_mask(leaves_settings_changed)
    assert result.diagnosis == "global_setting", result
    assert "torch.get_default_dtype() was torch.float32, is now torch.float64" in result.message
    assert "torch.is_grad_enabled() was True, is now False" in result.message
    assert _state()[:3] == before[:3]


def test_state_is_restored_after_a_failure_too():
    before = _state()

    def meddles_then_fails(n):
        torch.set_grad_enabled(False)
        torch.set_default_dtype(torch.float64)
        raise RuntimeError("broken")
    result = checks.check_causal_mask(meddles_then_fails)
    assert result.diagnosis == "exception" and "RuntimeError" in result.message
    assert _state()[:3] == before[:3]


def test_a_float64_notebook_is_judged_by_its_inputs_dtype():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert checks.check_toy_attention(attention.toy_attention).passed
        assert checks.check_scaled_dot_product_attention(attention.scaled_dot_product_attention).passed
        assert checks.check_masked_attention(attention.MaskedAttention).passed
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(previous)


# ---------------------------------------------------------------- hostile code ends in a verdict

@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGALRM"), reason="the time limit needs SIGALRM")
def test_an_endless_loop_is_stopped(monkeypatch):
    monkeypatch.setattr(run, "TIME_LIMIT_S", 0.5)

    def loops(n):
        while True:
            try:
                n += 1
            except Exception:   # a student's catch-all must not swallow the time limit
                pass
    import signal
    handler = signal.getsignal(signal.SIGALRM)
    start = time.perf_counter()
    result = checks.check_causal_mask(loops)
    assert time.perf_counter() - start < 10
    assert result.diagnosis == "timeout" and "0.5 seconds" in result.message
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0          # no alarm left to go off later
    assert signal.getsignal(signal.SIGALRM) is handler            # the kernel's own handler is back
    assert checks.check_causal_mask(attention.causal_mask).passed


def test_sys_exit_is_caught():
    def exits(n):
        sys.exit(1)
    result = checks.check_causal_mask(exits)
    assert result.diagnosis == "exception" and "sys.exit(1)" in result.message


def test_ctrl_c_still_interrupts_and_restores_state():
    grad = torch.is_grad_enabled()

    def interrupted(n):
        torch.set_grad_enabled(not grad)
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        checks.check_causal_mask(interrupted)
    assert torch.is_grad_enabled() == grad


@pytest.mark.parametrize("returned,words", [
    (np.tril(np.ones((4, 4), dtype=bool)), "numpy.ndarray"),
    ([[True]], "list"),
    (None, "nothing"),
])
def test_other_types_get_a_clear_diagnosis(returned, words):
    result = checks.check_scaled_dot_product_attention(lambda q, k, v, mask=None: returned)
    assert not result.passed and result.diagnosis in ("dtype", "shape"), result
    assert words.split(".")[-1] in result.message or "tensor" in result.message.lower()


# ---------------------------------------------------------------- inputs changed in place

def test_dividing_q_in_place_is_named():
    def sdpa(q, k, v, mask=None):
        q /= math.sqrt(q.shape[-1])   # changes the caller's q
        scores = q @ k.transpose(-2, -1)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores.softmax(-1) @ v
    result = checks.check_scaled_dot_product_attention(sdpa)
    assert result.diagnosis == "mutation" and "in place" in result.message, result


# ---------------------------------------------------------------- the checker's own failures

def test_a_checker_bug_is_not_blamed_on_the_student(monkeypatch):
    # an IndexError raised inside the checker's own code (no student frame in its traceback)
    monkeypatch.setattr(notebook01, "_toy_cases", functools.partial(operator.getitem, [], 0))
    result = checks.check_toy_attention(attention.toy_attention)
    assert result.diagnosis == "checker_error" and not result.passed
    assert "1.2" in result.message and "IndexError" in result.message and "report" in result.message
    assert "Your code" not in result.message


# Two checkers, compiled as course files (a frame in tests/ would count as the student's): one backpropagates
# through what the student's function returns, outside any gradient probe of its own, so what a broken graph
# turns into is the engine's rule; the other breaks a graph of its own before any student code ran.
_COURSE_CHECKERS = """
def check_grows(fn):
    for _ in range(2):   # two calls, each backpropagated: a graph kept from the first breaks the second
        x = torch.randn(3, requires_grad=True)
        call(fn, x).sum().backward()
    return "fine"


def check_own_graph(fn):
    torch.ones(2).sum().backward()
"""


def _course_checker(monkeypatch, name):
    from course_lib.classroom.checks._student_code import call
    from course_lib.classroom.exercises import BY_ID, Exercise
    monkeypatch.setitem(BY_ID, "99.2", Exercise("99.2", "grows", "grows", name, hints=("h", "i")))
    space = {"torch": torch, "call": call}
    # a file name in the course's own folder (a name that only holds "/course_lib/" is the student's)
    exec(compile(_COURSE_CHECKERS, os.path.join(os.path.dirname(course_lib.__file__), "classroom", "checks",
                                                "_a_checker.py"), "exec"), space)
    return run.checker("99.2")(space[name])


_KEPT: list = []


def _kept_from_the_first_call(x):
    if not _KEPT:
        _KEPT.append(x.exp())
    return _KEPT[0] * x


@pytest.mark.parametrize("student,diagnosis,words", [
    (lambda x: x.exp().add_(1), "mutation", "changed in place"),   # exp saves its output for backward
    (lambda x: torch.tensor(x.tolist()) * 2, "gradient", "not connected"),
    (_kept_from_the_first_call, "gradient", "earlier call"),
])
def test_a_graph_the_students_code_broke_is_their_verdict_with_its_cause(monkeypatch, student, diagnosis, words):
    _KEPT.clear()
    check = _course_checker(monkeypatch, "check_grows")
    result = check(student)
    assert (result.passed, result.diagnosis) == (False, diagnosis), result
    assert words in result.message and "bug in the course" not in result.message
    assert check(lambda x: x.exp() * 2).passed   # a graph that holds


def test_a_broken_graph_of_the_checkers_own_is_still_a_checker_error(monkeypatch):
    result = _course_checker(monkeypatch, "check_own_graph")(lambda x: x)
    assert result.diagnosis == "checker_error" and "bug in the course" in result.message


def _autograd_refusal(make):
    with pytest.raises(RuntimeError) as raised:
        make()
    return raised.value


def _saved_tensor_changed():
    x = torch.randn(3, requires_grad=True)
    y = x.exp()   # exp saves its output for the backward pass
    y.add_(1)
    y.sum().backward()


def _leaf_changed():
    torch.randn(3, requires_grad=True).add_(1)


def _backward_twice():
    y = torch.randn(3, requires_grad=True).exp().sum()
    y.backward()
    y.backward()


def test_autograd_errors_read_torchs_own_words():
    """The one reader of autograd's errors must still know torch's words: each refusal made by torch itself."""
    from course_lib.classroom.checks.engine import autograd_errors as errors
    saved = _autograd_refusal(_saved_tensor_changed)
    leaf = _autograd_refusal(_leaf_changed)
    cut = _autograd_refusal(lambda: torch.tensor([1.0]).sum().backward())
    twice = _autograd_refusal(_backward_twice)
    assert errors.is_in_place_error(saved) and errors.saved_tensor_changed(saved)
    assert errors.is_in_place_error(leaf) and not errors.saved_tensor_changed(leaf)
    assert not errors.is_in_place_error(cut) and not errors.is_in_place_error(twice)
    assert [errors.named_cause(e)[0] for e in (saved, cut, twice)] == ["mutation", "gradient", "gradient"]
    assert errors.named_cause(RuntimeError("shape mismatch")) is None


def test_a_student_error_is_still_the_students(monkeypatch):
    def toy(query, keys, values):
        return [][0]
    result = checks.check_toy_attention(toy)
    assert result.diagnosis == "exception" and "IndexError" in result.message and "line" in result.message


# ---------------------------------------------------------------- solutions from the notebooks

@pytest.mark.parametrize("exercise,must,must_not", [
    ("1.1", "def my_prediction", "def toy_attention"),
    ("1.2", "def toy_attention", "def my_prediction"),
    ("2.2", "class MaskedAttention", "class MultiHeadMaskedAttention"),
    ("3.3", "class MultiHeadMaskedAttention", "class MaskedAttention("),
    ("5.3", "def train_step", "Exercise 5.4"),
    ("7.2", "def attention_forward", "Exercise 7.1"),
])
def test_show_solution_shows_that_exercises_region(exercise, must, must_not, capsys):
    source = checks.show_solution(exercise, force=True)
    assert source.startswith(f"# Solution of exercise {exercise} (") and "SOLUTION" not in source
    assert must in source and must_not not in source
    assert f"exercise {exercise}" in capsys.readouterr().out


def test_show_solution_names_the_argument():
    with pytest.raises(ValueError, match="exercise_id: expected one of .*got '9.9'"):
        checks.show_solution("9.9")


# ---------------------------------------------------------------- 6.2's speed note

def test_a_cache_slower_than_no_cache_is_called_slower():
    from course_lib.classroom.checks import notebook06
    from course_lib.generate import generate

    def slow_generation(model, idx, max_new_tokens):
        time.sleep(0.02 * max_new_tokens)   # far slower than recomputing everything
        return generate(model, idx, max_new_tokens, temperature=0, use_cache=False)
    note = notebook06._speed_note(slow_generation)
    assert "SLOWER" in note and "about the same" not in note, note


def test_a_result_on_another_device_is_named():
    result = checks.check_scaled_dot_product_attention(
        lambda q, k, v, mask=None: torch.empty(*q.shape[:-1], v.shape[-1], device="meta"))
    assert result.diagnosis == "device" and "meta" in result.message, result


def test_a_default_device_is_set_aside_and_restored():
    if not hasattr(torch, "get_default_device"):
        pytest.skip("torch without default devices")
    torch.set_default_device("meta")
    try:
        result = checks.check_causal_mask(attention.causal_mask)
        assert torch.get_default_device().type == "meta"
    finally:
        torch.set_default_device(None)
    assert result.passed, result



# ---------------------------------------------------------------- every checker's reference is bound privately

_PATCHABLE = [("1.2", "course_lib.attention", "toy_attention"),
              ("1.3", "course_lib.attention", "scaled_dot_product_attention"),
              ("2.1", "course_lib.attention", "causal_mask"),
              ("3.1", "course_lib.attention", "split_heads"),
              ("3.2", "course_lib.attention", "merge_heads"),
              ("4.1", "course_lib.model", "sinusoidal_table"),
              ("5.1", "course_lib.data", "lm_windows"),
              ("5.2", "course_lib.train", "lm_loss"),
              ("5.4", "course_lib.generate", "sample_next_token"),
              ("6.1", "course_lib.train", "flops_per_token")]


@pytest.mark.parametrize("exercise,module,name", _PATCHABLE, ids=[e for e, _, _ in _PATCHABLE])
def test_patching_the_reference_to_the_wrong_answer_changes_nothing(exercise, module, name, monkeypatch):
    import importlib

    import test_checks_attention as ta
    import test_checks_model as tm
    from bank import attention_bugs, model_bugs
    bank, runner = (attention_bugs, ta) if int(exercise.split(".")[0]) <= 3 else (model_bugs, tm)
    wrong = next(a for a in bank.BUGGY if a.exercise == exercise and callable(a.candidate)
                 and a.expected not in ("not_implemented", "exception") and not getattr(a, "kwargs", None))
    honest = runner.run(exercise, wrong.candidate)
    monkeypatch.setattr(importlib.import_module(module), name, wrong.candidate)
    patched = runner.run(exercise, wrong.candidate)
    assert not patched.passed and patched.diagnosis == honest.diagnosis, (wrong.id, patched)
    assert getattr(importlib.import_module(module), name) is wrong.candidate


# ---------------------------------------------------------------- one comparison, one mistake type

def test_one_tolerance_derived_from_the_dtype():
    from course_lib.classroom.checks import _student_code as _compare
    x = torch.ones(4)
    assert _compare.tolerance(x) == _compare.tolerance(x.double()) == (1e-3, 1e-4)
    assert _compare.tolerance(x.half())[0] > 1e-3                       # coarser dtype, looser tolerance
    assert _compare.close(x, x + 5e-4) and not _compare.close(x, x + 5e-3)
    assert not _compare.close(x, torch.ones(5)) and not _compare.close(x, [1.0] * 4)


def test_every_hypothesised_mistake_is_a_mistake():
    from course_lib.classroom.checks import _attn_hypotheses, notebook01, notebook02, notebook03, notebook04
    from course_lib.classroom.exercises import Mistake
    declared = [d for module in (notebook01, notebook02, notebook03, notebook04) for d in vars(module).values()
                if isinstance(d, checks.engine.FunctionExercise)]
    assert len(declared) == 6
    hypotheses = (_attn_hypotheses.SDPA_HYPOTHESES + _attn_hypotheses.MODULE_HYPOTHESES
                  + tuple(m for d in declared for m in d.mistakes))
    assert all(isinstance(h, Mistake) for h in hypotheses)
    assert all(h.code in checks.DIAGNOSES for h in hypotheses)


def test_a_module_that_imports_checks_is_whole_during_a_check():
    """A classroom module imported next to checks (the old `from course_lib import capstone, checks` of
    notebook 08) is whole during a check: the harness never pins a half-built module."""
    import subprocess
    import sys
    code = ("from course_lib import capstone, checks\n"
            "from course_lib.classroom.capstone import TrainingRun\n"
            "ref = TrainingRun('reference', [1, 2], [3.0, 2.0], [2], [1.5])\n"
            "result = checks.check_trains_like_reference(TrainingRun('y', [1, 2], [3.0, 2.0], [2], [1.5]), ref)\n"
            "assert result.passed, result\n"
            "assert hasattr(capstone, 'find_blame') and hasattr(capstone, 'train_parts')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# ---------------------------------------------------------------- issue 27 section 4: more state, the checkers' own options

def _meddling_more(n):
    torch.autograd.set_detect_anomaly(True)
    torch.set_float32_matmul_precision("medium")
    os.chdir(tempfile.gettempdir())
    os.environ["COURSE_TEST_MEDDLED"] = "1"
    os.environ.pop("COURSE_TEST_KEPT", None)
    return torch.ones(n, n, dtype=torch.bool).tril()


def test_anomaly_mode_matmul_precision_cwd_and_environ_are_restored(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COURSE_TEST_KEPT", "yes")
    before = (torch.is_anomaly_enabled(), torch.get_float32_matmul_precision(), os.getcwd(), dict(os.environ))
    result = checks.check_causal_mask(_meddling_more)
    assert result.passed, result
    after = (torch.is_anomaly_enabled(), torch.get_float32_matmul_precision(), os.getcwd(), dict(os.environ))
    assert after == before


def test_a_working_directory_deleted_by_the_student_does_not_crash_the_check(tmp_path):
    doomed = tmp_path / "doomed"
    doomed.mkdir()

    def removes_its_folder(n):
        if doomed.exists():   # the checker calls it several times
            os.chdir(doomed)
            os.rmdir(doomed)
        return torch.ones(n, n, dtype=torch.bool).tril()
    here = os.getcwd()
    try:
        assert checks.check_causal_mask(removes_its_folder).passed
        assert os.getcwd() == here
    finally:
        os.chdir(here)


def _checkers_with_options():
    """Every public checker and its options (the parameters with a default), found by inspection."""
    found = []
    for name in dir(checks):
        fn = getattr(checks, name)
        if name.startswith("check_") and callable(fn) and hasattr(fn, "exercise"):
            body = inspect.unwrap(fn)
            for option, parameter in inspect.signature(body).parameters.items():
                if parameter.default is not inspect.Parameter.empty:
                    found.append((name, option, parameter.default))
    return found


def test_every_checker_option_is_found():
    names = {(name, option) for name, option, _ in _checkers_with_options()}
    assert ("check_transformer_block", "norm_first") in names


@pytest.mark.parametrize("name, option, default", _checkers_with_options())
@pytest.mark.parametrize("wrong", ["no", [1], float("nan")])
def test_a_wrong_option_is_refused_naming_it(name, option, default, wrong):
    with pytest.raises(TypeError, match=option):
        getattr(checks, name)(None, **{option: wrong}) if name != "check_trains_like_reference" else \
            getattr(checks, name)(None, None, **{option: wrong})


def test_a_string_is_not_a_boolean():
    from course_lib.model import TransformerBlock
    with pytest.raises(TypeError, match=r"norm_first: expected True or False \(a bool\), got 'no'"):
        checks.check_transformer_block(TransformerBlock, norm_first="no")
    assert checks.check_transformer_block(TransformerBlock, norm_first=False).passed


def test_an_unknown_option_or_a_missing_argument_is_named():
    with pytest.raises(TypeError, match="check_causal_mask: .*unexpected keyword argument 'strict'"):
        checks.check_causal_mask(attention.causal_mask, strict=True)
    with pytest.raises(TypeError, match="check_causal_mask: .*missing a required argument: 'fn'"):
        checks.check_causal_mask()


# ---------------------------------------------------------------- issue 20 section 1: the gradient probe itself

def _sdpa_by_einsum(q, k, v):
    scores = torch.einsum("nqd,nkd->nqk", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("nqk,nkd->nqd", scores.softmax(-1), v)


def test_gradients_of_another_layout_pass_and_a_cut_graph_fails():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 8, generator=gen) for _ in range(3))
    gradients.check_function_gradients(_sdpa_by_einsum, attention.scaled_dot_product_attention, q, k, v,
                                       names=("q", "k", "v"), what="sdpa")
    with pytest.raises(verdict.Failure) as failure:
        gradients.check_function_gradients(lambda q, k, v: _sdpa_by_einsum(q, k.detach(), v),
                                           attention.scaled_dot_product_attention, q, k, v,
                                           names=("q", "k", "v"), what="sdpa")
    assert failure.value.diagnosis == "gradient" and "`k`" in failure.value.message


def test_a_partly_cut_path_names_the_wrong_gradient():
    x = torch.randn(3, 4)
    with pytest.raises(verdict.Failure) as failure:   # right value, half the gradient
        gradients.check_function_gradients(lambda x: x * x.detach(), lambda x: x * x, x, names=("x",), what="f")
    assert failure.value.diagnosis == "gradient" and "differs" in failure.value.message


def test_a_module_with_a_frozen_parameter_is_named():
    reference = torch.nn.Linear(4, 3)
    frozen = torch.nn.Linear(4, 3)
    frozen.load_state_dict(reference.state_dict())
    frozen.bias.requires_grad_(False)
    with pytest.raises(verdict.Failure) as failure:
        gradients.check_module_gradients(frozen, reference, torch.randn(2, 4), what="layer")
    assert failure.value.diagnosis == "gradient" and "bias" in failure.value.message
    frozen.bias.requires_grad_(True)
    gradients.check_module_gradients(frozen, reference, torch.randn(2, 4), what="layer")
    assert all(p.grad is None for p in (*frozen.parameters(), *reference.parameters()))   # left as given


def test_the_new_diagnoses_are_registered():
    for code in ("gradient", "zero_grad", "flops_factor", "split_transpose", "final_norm", "no_kv_cache",
                 "overlapping_windows"):
        assert code in checks.DIAGNOSES


# ---------------------------------------------------------------- the table names every checker

def test_every_exercise_of_the_table_has_its_checker_in_checks():
    from course_lib.classroom.exercises import EXERCISES
    for entry in EXERCISES:
        found = getattr(checks, entry.checker, None)
        assert found is not None and found.exercise == entry.id, entry
