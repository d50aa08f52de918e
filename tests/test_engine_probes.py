"""Issue 43 §3: every exercise answered by a function gets every shared probe from the engine, proven by
behaviour, not by a list: for each declaration, a correct attempt of the bank (a student's, not the course's
reference, which the guard refuses) with one probe's mistake planted around it must get that probe's verdict.

- ``mutation``: the attempt, then its first tensor input changed in place;
- ``gradient``: the attempt's output detached (where the reference's output is differentiable);
- ``dtype``: the attempt's output cast to float32 (where it is floating point): wrong in a float64 notebook;
- ``global_state``: the attempt, with ``torch.equal`` replaced while it runs;
- ``reference_guard``: a call of the course's own function;
- ``magnitude``: an attempt with every softmax (log-softmax, log-sum-exp, cross-entropy, fused attention)
  computed naively, exp(x) / sum(exp(x)) (where the reference computes one);
- ``counterexample``: the checker derives one.

A new exercise declared without one of these fails here. Exercises answered otherwise (a class, two outputs)
are listed with the reason in ``JUDGED_OTHERWISE``, and the table must name them.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_checks_bank import CORRECT
from torch.overrides import TorchFunctionMode

from course_lib.classroom import checks
from course_lib.classroom.checks.engine import FunctionExercise
from course_lib.classroom.checks.engine.probes import in_float64
from course_lib.classroom.checks.engine.run import reference_of
from course_lib.classroom.exercises import BY_ID, EXERCISES

# Exercises whose answer is not one function of the declaration's cases: judged by a procedure of their own.
JUDGED_OTHERWISE = {
    "10.2": "flash_attention returns (out, lse): two declarations, one check (check_flash_attention)",
    "10.3": "FlashAttentionFunction is a class: its backward is judged through the gradients it gives",
}

# Where a probe has nothing to find, and why.
NOT_TRAINED_THROUGH = {"7.1": "split_c_attn rearranges pretrained weights for loading; nothing is trained through it"}
NUMBER_ANSWERS = {"6.1": "flops_per_token answers a count, read as a Python number: no dtype of the notebook's"}


def _declarations() -> dict[str, FunctionExercise]:
    found = {}
    for name in dir(checks):
        if name.startswith("notebook"):
            for value in vars(getattr(checks, name)).values():
                if isinstance(value, FunctionExercise) and value.id not in JUDGED_OTHERWISE:
                    found[value.id] = value
    return dict(sorted(found.items(), key=lambda item: tuple(map(int, item[0].split(".")))))


DECLARATIONS = _declarations()
IDS = list(DECLARATIONS)


def _attempts(exercise: str) -> list:
    return [attempt.candidate for attempt in CORRECT if attempt.exercise == exercise]


def _check(declaration: FunctionExercise, candidate):
    check = getattr(checks, BY_ID[declaration.id].checker)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check(candidate)


def _each(value, change):
    """``change`` applied to the output, or to each tensor of a tuple of outputs (rope_tables, split_c_attn)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_each(v, change) for v in value)
    return change(torch.as_tensor(value) if not isinstance(value, torch.Tensor) else value)


def _tensors(args) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


def test_every_function_exercise_is_declared_or_judged_otherwise():
    declared = set(DECLARATIONS) | set(JUDGED_OTHERWISE)
    assert set(JUDGED_OTHERWISE) <= set(BY_ID)
    functions = {e.id for e in EXERCISES if e.id in declared}
    assert functions == declared, declared - functions
    assert len(DECLARATIONS) >= 19
    assert all(_attempts(exercise) for exercise in DECLARATIONS), "each needs a correct attempt in the bank"


@pytest.mark.parametrize("exercise", IDS)
def test_an_input_changed_in_place_is_found(exercise):
    declaration, attempt = DECLARATIONS[exercise], _attempts(exercise)[0]
    if not any(_tensors(case.args) for case in declaration.cases()):
        assert "mutation" in declaration.probes   # no tensor to change: the probe has nothing to watch
        return

    def candidate(*args, **kwargs):
        out = attempt(*args, **kwargs)
        first = _tensors(list(args) + list(kwargs.values()))[0]
        with torch.no_grad():
            first.logical_not_() if first.dtype == torch.bool else first.add_(1)
        return out

    result = _check(declaration, candidate)
    assert (result.passed, result.diagnosis) == (False, "mutation"), result


def _differentiable(declaration: FunctionExercise) -> bool:
    for case in declaration.cases():
        args = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in case.args]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = declaration.reference(*args)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            return True
    return False


@pytest.mark.parametrize("exercise", IDS)
def test_a_cut_graph_is_found_where_the_output_is_differentiable(exercise):
    declaration, attempt = DECLARATIONS[exercise], _attempts(exercise)[0]
    if not _differentiable(declaration) or exercise in NOT_TRAINED_THROUGH:
        return   # nothing flows back through this exercise's inputs (a mask, windows of tokens, a count)
    result = _check(declaration, lambda *args, **kwargs: _each(attempt(*args, **kwargs), torch.Tensor.detach))
    assert (result.passed, result.diagnosis) == (False, "gradient"), result


@pytest.mark.parametrize("exercise", IDS)
def test_a_dtype_written_into_the_code_is_found(exercise):
    declaration, attempt = DECLARATIONS[exercise], _attempts(exercise)[0]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = declaration.reference(*in_float64(declaration.cases()[0].args))
    finally:
        torch.set_default_dtype(previous)
    if not (isinstance(out, torch.Tensor) and out.dtype == torch.float64) or exercise in NUMBER_ANSWERS:
        return   # a mask, token ids, a count: the default dtype never enters

    result = _check(declaration, lambda *args, **kwargs: _each(attempt(*args, **kwargs), torch.Tensor.float))
    if not any(isinstance(a, torch.Tensor) and a.is_floating_point() for a in declaration.cases()[0].args):
        # nothing to take a dtype from (4.1's two ints) and no dtype asked: float32 is as right as the default
        assert result.passed, result
        return
    assert (result.passed, result.diagnosis) == (False, "dtype"), result
    assert "float64" in result.message


@pytest.mark.parametrize("exercise", IDS)
def test_a_result_in_the_default_dtype_is_found(exercise):
    """A new tensor made without dtype= takes the notebook's default: float32 out for float64 in, as float16 in
    would give float32 out (the probe's first pass keeps the notebook's default)."""
    declaration, attempt = DECLARATIONS[exercise], _attempts(exercise)[0]
    case = declaration.cases()[0]
    floats = [a for a in case.args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if any(isinstance(a, torch.nn.Module) for a in case.args):
        return   # a layer made in the default dtype takes no float64 input (12.2): the float64 notebook's pass
    out = declaration.reference(*in_float64(case.args)) if floats else None
    if not (isinstance(out, torch.Tensor) and out.dtype == torch.float64) or exercise in NUMBER_ANSWERS:
        return   # nothing to take a dtype from, or no floating output

    def candidate(*args, **kwargs):
        result = attempt(*args, **kwargs)
        return _each(result, lambda t: torch.zeros(t.shape, device=t.device).copy_(t) if t.is_floating_point() else t)

    result = _check(declaration, candidate)
    assert (result.passed, result.diagnosis) == (False, "dtype"), result
    assert "float64" in result.message


@pytest.mark.parametrize("exercise", [e for e in IDS if "bfloat16" in DECLARATIONS[e].probes])
def test_a_float32_tensor_that_float64_hides_is_found_in_bfloat16(exercise):
    """Where the text asks for the inputs' dtype: a zero made in the default dtype added to the result. Float64
    inputs promote it away (the dtype probe passes); bfloat16 ones are promoted by it to float32."""
    attempt = _attempts(exercise)[0]

    def candidate(*args, **kwargs):
        return _each(attempt(*args, **kwargs), lambda t: t + torch.zeros(t.shape[-1:], device=t.device)
                     if t.is_floating_point() and t.dtype != torch.float32 else t)

    result = _check(DECLARATIONS[exercise], candidate)
    assert (result.passed, result.diagnosis) == (False, "dtype"), result
    assert "bfloat16" in result.message or "float16" in result.message   # 9.2's own cases hold float16 x


@pytest.mark.parametrize("exercise", [e for e in IDS if e not in NUMBER_ANSWERS])
def test_a_random_draw_in_the_result_is_dropout(exercise):
    """Noise drawn from torch's random state at every call, on a floating result: the same seed gives the same
    output (nothing kept), other seeds another (a draw), and the reference has none: ``dropout``."""
    declaration, attempt = DECLARATIONS[exercise], _attempts(exercise)[0]
    out = declaration.reference(*declaration.cases()[0].args)
    if not (isinstance(out, torch.Tensor) and out.is_floating_point()):
        return   # a mask, token ids: no noise to add

    def candidate(*args, **kwargs):
        # never near zero: a draw that happened to be tiny would make the output right by chance
        return _each(attempt(*args, **kwargs), lambda t: t + 0.1 + 0.1 * torch.rand(t.shape, dtype=t.dtype,
                                                                                    device=t.device)
                     if t.is_floating_point() else t)

    result = _check(declaration, candidate)
    assert (result.passed, result.diagnosis) == (False, "dropout"), result


@pytest.mark.parametrize("exercise", [e for e in IDS if "device" in DECLARATIONS[e].probes])
def test_a_result_copied_to_the_cpu_is_found(exercise):
    """Where the text asks for x's device: the attempt's result moved with .cpu() (a no-op on a CPU)."""
    attempt = _attempts(exercise)[0]
    result = _check(DECLARATIONS[exercise], lambda *args, **kwargs: _each(attempt(*args, **kwargs), torch.Tensor.cpu))
    assert (result.passed, result.diagnosis) == (False, "device"), result


def test_the_device_probe_is_asked_where_the_text_asks_for_the_device():
    assert sorted(e for e in IDS if "device" in DECLARATIONS[e].probes) == ["11.1", "11.2", "12.3", "3.1", "3.2", "5.2", "7.1", "9.2", "9.5"]


@pytest.mark.parametrize("exercise", IDS)
def test_torch_replaced_while_the_code_runs_is_found(exercise):
    declaration, attempt = DECLARATIONS[exercise], _attempts(exercise)[0]
    equal = torch.equal

    def candidate(*args, **kwargs):
        torch.equal = lambda *a, **k: True
        return attempt(*args, **kwargs)

    try:
        result = _check(declaration, candidate)
    finally:
        torch.equal = equal
    assert (result.passed, result.diagnosis) == (False, "patched"), result


@pytest.mark.parametrize("exercise", IDS)
def test_calling_the_courses_own_version_is_found(exercise):
    declaration, reference = DECLARATIONS[exercise], reference_of(exercise)
    if reference is None:   # 12.2: a function of a layer; calling the layer's own forward is its own verdict
        reference = declaration.reference
    result = _check(declaration, lambda *args, **kwargs: reference(*args, **kwargs))
    assert (result.passed, result.diagnosis) == (False, "calls_reference"), result


@pytest.mark.parametrize("exercise", IDS)
def test_a_counterexample_is_derived(exercise):
    assert getattr(checks, BY_ID[exercise].checker).example is not None


# ---------------------------------------------------------------- magnitude

def _naive_softmax(x, dim):
    e = torch.exp(x)
    return e / e.sum(dim, keepdim=True)


class NaiveSoftmax(TorchFunctionMode):
    """Every softmax the code under it computes, computed as exp(x) / sum(exp(x)): no maximum subtracted."""

    WATCHED = ("softmax", "log_softmax", "logsumexp", "cross_entropy", "scaled_dot_product_attention")

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name not in self.WATCHED:
            return func(*args, **kwargs)
        self.seen.add(name)
        if name == "softmax":
            return _naive_softmax(args[0], kwargs.get("dim", args[1] if len(args) > 1 else -1))
        if name == "log_softmax":
            return torch.log(_naive_softmax(args[0], kwargs.get("dim", args[1] if len(args) > 1 else -1)))
        if name == "logsumexp":
            dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
            return torch.log(torch.exp(args[0]).sum(dim, keepdim=kwargs.get("keepdim", False)))
        if name == "cross_entropy":
            logits, target = args[0], args[1]
            log_probs = torch.log(_naive_softmax(logits, 1 if logits.dim() > 1 else 0))
            return F.nll_loss(log_probs, target, ignore_index=kwargs.get("ignore_index", -100))
        q, k, v = args[:3]   # scaled_dot_product_attention
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        scores = q @ k.transpose(-2, -1) * kwargs.get("scale", None) if kwargs.get("scale") is not None \
            else q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if kwargs.get("is_causal"):
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        return _naive_softmax(scores, -1) @ v


def _calls_softmax(declaration: FunctionExercise, attempt, monkeypatch) -> bool:
    """Whether the attempt, run by its check as a student's code is (in process, to watch it), calls a softmax."""
    mode = NaiveSoftmax()

    def spy(*args, **kwargs):
        with mode:
            return attempt(*args, **kwargs)
    with monkeypatch.context() as patch:
        patch.setenv("COURSE_CHECK_IN_PROCESS", "1")
        _check(declaration, spy)
    return bool(mode.seen)


@pytest.mark.parametrize("exercise", IDS)
def test_a_softmax_without_its_maximum_is_found_where_the_exercise_computes_one(exercise, monkeypatch):
    declaration = DECLARATIONS[exercise]
    cases = declaration.cases()   # made outside the mode: only the reference's own operations count
    mode = NaiveSoftmax()
    with warnings.catch_warnings(), mode:
        warnings.simplefilter("ignore")
        for case in cases:
            declaration.reference(*case.args)
    if not mode.seen:
        return   # no softmax, log-softmax or attention in this exercise's work
    attempt = next((a for a in _attempts(exercise) if _calls_softmax(declaration, a, monkeypatch)), None)
    assert attempt is not None, f"{exercise}: the bank needs a correct attempt that calls a softmax"

    def candidate(*args, **kwargs):
        with NaiveSoftmax():
            return attempt(*args, **kwargs)

    result = _check(declaration, candidate)
    assert not result.passed and result.diagnosis in ("overflow", "magnitude", "nan"), result


# ---------------------------------------------------------------- kept state: the engine's helpers

def test_a_weight_step_changes_shared_parameters_alike_and_is_undone():
    from course_lib.classroom.checks.engine.probes import weight_step
    one, two = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    two.load_state_dict(one.state_dict())
    before = {name: p.detach().clone() for name, p in one.named_parameters()}
    undo = weight_step(one, two)
    for (name, p), q in zip(one.named_parameters(), two.parameters()):
        assert not torch.equal(p, before[name]) and torch.equal(p, q)
    undo()
    assert all(torch.equal(p, before[name]) for name, p in one.named_parameters())


def test_a_draw_repeated_at_any_period_is_found():
    from course_lib.classroom.checks.engine.probes import repeated_draw
    new = [torch.tensor([i]) for i in range(6)]
    assert repeated_draw(new, torch.equal) is None
    for period in (2, 3, 4, 5):
        kept = [torch.tensor([i // period]) for i in range(6)]          # redrawn every `period` calls only
        cycled = [torch.tensor([i % (period - 1)]) for i in range(6)]   # `period - 1` masks used in turn
        assert repeated_draw(kept, torch.equal) is not None
        assert repeated_draw(cycled, torch.equal) is not None


def test_a_result_that_changes_with_earlier_calls_is_told_from_a_random_draw():
    from course_lib.classroom.checks.engine.probes import random_or_kept
    calls = []
    assert random_or_kept(lambda: torch.rand(3), torch.equal) == "random"
    assert random_or_kept(lambda: calls.append(1) or torch.tensor([len(calls)]), torch.equal) == "kept"
    assert random_or_kept(lambda: torch.zeros(3), torch.equal) is None
