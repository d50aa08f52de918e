"""Issue 43 §3 for every exercise that is NOT one function of the engine's cases (a module, a procedure, a
context manager, an autograd.Function), the sibling of ``test_engine_probes.py``: each shared probe is proven by
behaviour, a correct attempt of the bank with one probe's mistake planted around it must get that probe's verdict.

- ``mutation``: the attempt, then its first tensor argument changed in place (a module: ``forward``'s input);
- ``gradient``: the attempt's output detached (11.3: the model frozen inside the ``with``; 10.3: a backward that
  returns nothing), where something is trained through it;
- ``dtype``: the attempt's floating output cast to float32 (a module, 7.2, 10.2, 10.3), or what a float64 notebook
  reaches of a procedure: the model it is given made float32 (5.3, 6.2, 11.3), a float32 buffer its float64 logits
  are written into (5.4);
- ``global_state``: ``torch.equal`` replaced while the attempt runs;
- ``reference_guard``: the attempt handing its work to the course's own version;
- ``counterexample``: the checker derives one;
- ``magnitude``, where the student writes a softmax or a normalisation: the sampler's softmax computed naively
  (5.4), the norm fed its input clamped to +-1e4 (9.3), the tiled loop's every maximum made 0 (10.2), all right on
  ordinary inputs; every other exercise is in
  ``NO_MAGNITUDE`` with the reason.

Every exercise of the table that ``test_engine_probes`` does not hold to these is held here: a new exercise with
no correct attempt in the bank, or one of these probes missing, fails, unless ``DOES_NOT_APPLY`` names the probe
with the reason (and the table names only real exercises and probes).
"""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from test_checks_bank import CORRECT
from test_engine_probes import DECLARATIONS, NaiveSoftmax
from torch.overrides import TorchFunctionMode

from course_lib.classroom import checks
from course_lib.classroom.checks.engine.run import reference_of
from course_lib.classroom.exercises import BY_ID, EXERCISES

PLANTED = ("mutation", "gradient", "dtype", "global_state", "reference_guard")
_NO_CODE = "the answer is not code: "

# Where a probe has nothing to find, and why.
DOES_NOT_APPLY: dict[str, dict[str, str]] = {
    "1.1": {probe: _NO_CODE + "a prediction written by hand, numbers checked against the reference's"
            for probe in PLANTED},
    "8.1": {probe: _NO_CODE + "two finished TrainingRuns compared by their validation losses (the parts that trained "
                              "were checked by their own exercises)" for probe in PLANTED},
    "5.3": {"gradient": "a training step returns a number; the check watches its backward and step by the weights' "
                        "update (zero_grad, clipping, one step along the batch's gradient)"},
    "5.4": {"gradient": "token ids drawn at random: nothing is trained through a sampler"},
    "6.2": {"gradient": "token ids of greedy generation under torch.no_grad: nothing is trained through them"},
    "10.2": {"gradient": "flash_attention is the tiled forward pass only: its gradients are exercise 10.3's, an "
                         "autograd.Function that recomputes them; nothing is trained through 10.2's loops"},
    "10.3": {"dtype": "autograd casts each gradient a backward returns to its input's dtype, so a float32 written "
                      "into the backward can only show as lost precision (10.3's own precision verdict)"},
    "11.3": {"mutation": "ablate_head takes a model, no tensor: what it may change is the model's state (hooks, "
                         "mode, requires_grad, weights), judged by the model_state probe"},
}

OTHERS = [entry.id for entry in EXERCISES if entry.id not in DECLARATIONS]


def _attempts(exercise: str) -> list:
    return [attempt.candidate for attempt in CORRECT if attempt.exercise == exercise]


def _check(exercise: str, candidate):
    check = getattr(checks, BY_ID[exercise].checker)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check(candidate)


def _applies(exercise: str, probe: str) -> bool:
    return probe not in DOES_NOT_APPLY.get(exercise, {})


def _kind(attempt) -> str:
    if isinstance(attempt, type) and issubclass(attempt, torch.autograd.Function):
        return "function_class"
    if isinstance(attempt, type):
        return "module"
    return "function"


def _first_tensor(args) -> torch.Tensor:
    return next(a for a in args if isinstance(a, torch.Tensor))


def _change_in_place(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.logical_not_() if t.dtype == torch.bool else t.add_(1)


def _each(value, change):
    """``change`` applied to the output, or to each tensor of a tuple of outputs (7.2, 10.2: (out, second))."""
    if isinstance(value, (tuple, list)):
        return type(value)(change(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in value)
    return change(value)


def _planted(exercise: str, attempt, *, before=None, after=None, output=None):
    """The attempt with a mistake planted around its work: ``before(args)`` and ``after(args)`` run around the call
    (a module's forward, a function, a context manager's body), ``output`` changes what it returns."""
    def around(work, args, kwargs):
        if before is not None:
            before(args)
        out = work(*args, **kwargs)
        if after is not None:
            after(args)
        return out if output is None else _each(out, output)

    kind = _kind(attempt)
    if kind == "module":
        class Planted(attempt):
            def forward(self, *args, **kwargs):
                return around(super().forward, args, kwargs)
        Planted.__name__ = Planted.__qualname__ = attempt.__name__
        return Planted
    if kind == "function_class":   # 10.3: the backward is the exercise
        class PlantedFunction(attempt):
            @staticmethod
            def backward(ctx, *grads):
                return around(lambda *g: attempt.backward(ctx, *g), grads, {})
        PlantedFunction.__name__ = PlantedFunction.__qualname__ = attempt.__name__
        return PlantedFunction
    if exercise == "11.3":   # a context manager: the mistake runs inside its `with`
        @contextlib.contextmanager
        def planted_manager(model, *args, **kwargs):
            with attempt(model, *args, **kwargs) as value:
                around(lambda *a: None, (model,), {})
                yield value
        return planted_manager

    def planted(*args, **kwargs):
        return around(attempt, args, kwargs)
    return planted


def test_every_exercise_is_held_to_the_probes_here_or_in_test_engine_probes():
    assert set(OTHERS) | set(DECLARATIONS) == set(BY_ID)
    assert {"2.2", "3.3", "4.2", "4.3", "5.3", "5.4", "6.2", "7.2", "9.3", "9.4", "9.6"} <= set(OTHERS)
    assert set(DOES_NOT_APPLY) <= set(OTHERS), "the table names an exercise that is not judged here"
    assert all(set(probes) <= set(PLANTED) and all(len(why) > 30 for why in probes.values())
               for probes in DOES_NOT_APPLY.values())
    missing = [e for e in OTHERS if not all(not _applies(e, p) for p in PLANTED) and not _attempts(e)]
    assert not missing, f"each needs a correct attempt in the bank: {missing}"


def _attempt(exercise: str):
    return _attempts(exercise)[0]


@pytest.mark.parametrize("exercise", OTHERS)
def test_an_input_changed_in_place_is_found(exercise):
    if not _applies(exercise, "mutation"):
        return
    attempt = _attempt(exercise)
    if _kind(attempt) == "function_class":   # grad_out, given to the backward
        candidate = _planted(exercise, attempt, after=lambda grads: _change_in_place(grads[0]))
    else:
        candidate = _planted(exercise, attempt, after=lambda args: _change_in_place(_first_tensor(args)))
    result = _check(exercise, candidate)
    assert (result.passed, result.diagnosis) == (False, "mutation"), result


def _freeze(args) -> None:
    for p in args[0].parameters():
        p.requires_grad_(False)


@pytest.mark.parametrize("exercise", OTHERS)
def test_a_cut_graph_is_found(exercise):
    if not _applies(exercise, "gradient"):
        return
    attempt = _attempt(exercise)
    if _kind(attempt) == "function_class":
        candidate = _planted(exercise, attempt, output=lambda g: None)   # the backward gives no gradients
    elif exercise == "11.3":
        candidate = _planted(exercise, attempt, before=_freeze)   # the model frozen inside the `with`
    else:
        candidate = _planted(exercise, attempt, output=torch.Tensor.detach)
    result = _check(exercise, candidate)
    assert not result.passed and result.diagnosis in ("gradient", "model_state"), result


_DTYPE_PLANTS = {
    # what a float64 notebook reaches of a procedure: the model it is given, or its float64 logits
    "5.3": {"before": lambda args: args[0].float()},
    "6.2": {"before": lambda args: args[0].float()},
    "11.3": {"before": lambda args: args[0].float()},
    "5.4": {"before": lambda args: torch.zeros(args[0].shape, dtype=torch.float32).scatter_(
        -1, torch.zeros(args[0].shape[0], 1, dtype=torch.long), args[0][:, :1])},
}


@pytest.mark.parametrize("exercise", OTHERS)
def test_a_dtype_written_into_the_code_is_found(exercise):
    if not _applies(exercise, "dtype"):
        return
    # float32 only where the notebook is float64: float16 (9.3's own half-precision check) stays as it was
    plant = _DTYPE_PLANTS.get(exercise, {"output": lambda out: out.float() if out.dtype == torch.float64 else out})
    result = _check(exercise, _planted(exercise, _attempt(exercise), **plant))
    assert (result.passed, result.diagnosis) == (False, "dtype"), result
    assert "float64" in result.message


@pytest.mark.parametrize("exercise", OTHERS)
def test_torch_replaced_while_the_code_runs_is_found(exercise):
    if not _applies(exercise, "global_state"):
        return
    equal = torch.equal

    def replace(args):
        torch.equal = lambda *a, **k: True
    try:
        result = _check(exercise, _planted(exercise, _attempt(exercise), before=replace))
    finally:
        torch.equal = equal
    assert (result.passed, result.diagnosis) == (False, "patched"), result


@pytest.mark.parametrize("exercise", OTHERS)
def test_calling_the_courses_own_version_is_found(exercise):
    if not _applies(exercise, "reference_guard"):
        return
    reference, attempt = reference_of(exercise), _attempt(exercise)
    assert reference is not None, f"{exercise}: the guard has no reference to watch"
    kind = _kind(attempt)
    if kind == "module":
        candidate = type(attempt.__name__, (attempt,), {"forward": lambda self, *a, **k: reference.forward(self, *a, **k)})
    elif kind == "function_class":
        candidate = type(attempt.__name__, (attempt,), {"backward": staticmethod(
            lambda ctx, *grads: reference.backward(ctx, *grads))})
    else:
        def candidate(*args, **kwargs):
            return reference(*args, **kwargs)
    result = _check(exercise, candidate)
    assert (result.passed, result.diagnosis) == (False, "calls_reference"), result


@pytest.mark.parametrize("exercise", OTHERS)
def test_a_counterexample_is_derived(exercise):
    assert getattr(checks, BY_ID[exercise].checker).example is not None


@pytest.mark.parametrize("exercise", [e for e in OTHERS if _applies(e, "dtype")])
def test_a_correct_attempt_passes_in_a_float64_notebook(exercise):
    """The checks run in the notebook's default dtype: a float64 notebook's right answer is right (the probes'
    own float64 runs included)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        result = _check(exercise, _attempt(exercise))
    finally:
        torch.set_default_dtype(previous)
    assert result.passed, result


# ---------------------------------------------------------------- magnitude

_MASKED = ("masked attention from the module's own weights: masking after the softmax and renormalising (right, "
           "and in the bank) underflows on scores of several hundred like a softmax without its maximum, so a "
           "magnitude probe would refuse right answers (_attn_modules.module_check)")
NO_MAGNITUDE = {
    "1.1": _NO_CODE + "a prediction written by hand",
    "8.1": _NO_CODE + "two finished training runs",
    "2.2": _MASKED, "3.3": _MASKED, "9.6": _MASKED, "7.2": _MASKED,
    "4.2": "the block's only softmax is inside self.attn, the course's MultiHeadMaskedAttention: the student writes none",
    "4.3": "the GPT's softmax is inside the blocks, the course's TransformerBlock: the student writes none",
    "5.3": "the loss is the course's lm_loss (torch's cross-entropy, a stable log-softmax): the step writes none",
    "6.2": "greedy generation takes an argmax of the logits: no softmax",
    "9.4": "SwiGLU has no softmax and no normalisation (SiLU and products of the weights)",
    "10.3": "the backward recomputes exp(S - lse) from the forward's log-sum-exp (the course's forward): a backward "
            "without lse is wrong on ordinary inputs already",
    "11.3": "an ablation zeroes a head's output: no softmax or normalisation of the student's",
}


def _naive_sampler(attempt):
    def candidate(*args, **kwargs):
        with NaiveSoftmax():
            return attempt(*args, **kwargs)
    return candidate


def _clamped_norm(attempt):
    class Clamped(attempt):
        def forward(self, x):
            return super().forward(x.clamp(-1e4, 1e4))   # right for ordinary x, wrong for rows of 1e15
    Clamped.__name__ = Clamped.__qualname__ = attempt.__name__
    return Clamped


class NoMaximum(TorchFunctionMode):
    """Every maximum the code under it takes is 0: an online softmax then computes exp(s - 0), right on ordinary
    scores and overflowing on scores of hundreds, the class of a running maximum that starts at 0, or none."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name in ("maximum", "amax") or (name == "max" and isinstance(out, torch.Tensor)):
            return torch.zeros_like(out)
        if name == "max":   # max(dim=...): (values, indices)
            return torch.return_types.max((torch.zeros_like(out.values), out.indices))
        return out


def _no_maximum(attempt):
    def candidate(*args, **kwargs):
        with NoMaximum():
            return attempt(*args, **kwargs)
    return candidate


MAGNITUDE = {"5.4": _naive_sampler, "9.3": _clamped_norm, "10.2": _no_maximum}


def test_every_exercise_has_a_magnitude_probe_or_the_reason_it_has_none():
    assert set(MAGNITUDE) | set(NO_MAGNITUDE) == set(OTHERS)
    assert not set(MAGNITUDE) & set(NO_MAGNITUDE)


@pytest.mark.parametrize("exercise", sorted(MAGNITUDE))
def test_a_softmax_or_norm_that_breaks_on_large_inputs_is_found(exercise):
    result = _check(exercise, MAGNITUDE[exercise](_attempt(exercise)))
    assert not result.passed and result.diagnosis in ("overflow", "magnitude"), result


# exp(600) is finite in float64: a loop that works in float64 needs no maximum for the probe's scores of hundreds
_WORKS_IN_FLOAT64 = {"flash_accumulates_in_float64", "flash_through_one_stack_in_float64"}


@pytest.mark.parametrize("attempt", [a for a in _attempts("10.2") if a.__name__ not in _WORKS_IN_FLOAT64],
                         ids=lambda a: a.__name__)
def test_every_correct_tiled_loop_without_its_maximum_is_found(attempt):
    """10.2's magnitude probe on every float32 layout of the bank, each right on ordinary scores without a maximum."""
    assert _check("10.2", attempt).passed
    result = _check("10.2", _no_maximum(attempt))
    assert not result.passed and result.diagnosis in ("overflow", "magnitude", "nan"), result


def test_the_float64_loop_kept_out_of_the_magnitude_test_exists():
    assert _WORKS_IN_FLOAT64 <= {a.__name__ for a in _attempts("10.2")}
