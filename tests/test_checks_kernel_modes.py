"""A check called from any state of the student's kernel (a fault run of the checks, 2026-11-29): the modes a
notebook cell may be in, numbers that compare as close when they are not, values of the student's that reached
the course's own arithmetic, interpreter settings a student's code changes, and a signal that lands in the
check's own watcher. Each is the student's verdict or no verdict at all, never the course's error."""
from __future__ import annotations

import gc
import logging
import math
import signal
import sys
import warnings

import pytest
import torch
from bank.model_bugs import step_classic
from guard_watcher import raise_once_in_the_watcher

from course_lib.classroom import checks
from course_lib.classroom.checks.engine import run
from course_lib.classroom.training_runs import TrainingRun


def _attention(q, k, v, mask=None):
    """A right 1.3."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# ---------------------------------------------------------------- the cell's modes are not the check's

def test_right_code_passes_from_a_cell_in_inference_mode_and_the_mode_is_kept(check_process):
    with torch.inference_mode():
        result = checks.check_scaled_dot_product_attention(_attention, graded=False)
        assert torch.is_inference_mode_enabled()
    assert result.passed, result


def test_right_code_passes_from_a_cell_under_autocast_and_autocast_is_kept(check_process):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = checks.check_apply_rotary(_apply_rotary, graded=False)
        assert torch.is_autocast_enabled("cpu")
    assert result.passed, result


def _apply_rotary(x, cos, sin, offset=0):
    length = x.shape[-2]
    cos, sin = cos[offset:offset + length].to(x.dtype), sin[offset:offset + length].to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


# ---------------------------------------------------------------- NaN is never within a tolerance

_good_step = step_classic   # a right 5.3 from the bank


def test_a_train_step_that_returns_nan_is_refused_as_nan():
    assert checks.check_train_step(_good_step, graded=False).passed

    def nan_step(*args, **kwargs):
        _good_step(*args, **kwargs)
        return float("nan")
    result = checks.check_train_step(nan_step, graded=False)
    assert (result.passed, result.diagnosis) == (False, "nan"), result


def _run(label, val_loss, train_loss=(3.0, 2.5, 2.2)):
    return TrainingRun(label, step=list(range(1, len(train_loss) + 1)), train_loss=list(train_loss),
                       val_step=[len(train_loss)], val_loss=[val_loss])


def test_a_training_run_with_a_nan_loss_never_trains_like_the_reference():
    reference = _run("reference", 2.0)
    assert checks.check_trains_like_reference(_run("yours", 2.001), reference, graded=False).passed
    result = checks.check_trains_like_reference(_run("yours", float("nan")), reference, graded=False)
    assert (result.passed, result.diagnosis) == (False, "nan"), result
    result = checks.check_trains_like_reference(_run("yours", 2.0, (3.0, float("nan"), 2.2)), reference,
                                                graded=False)
    assert (result.passed, result.diagnosis) == (False, "nan"), result


@pytest.mark.parametrize("yours", [TrainingRun("empty"), _run("words", 2.0, ("3.0", "2.5"))],
                         ids=["no losses", "losses as text"])
def test_odd_training_runs_are_the_students_verdict(yours):
    result = checks.check_trains_like_reference(yours, _run("reference", 2.0), graded=False)
    assert (result.passed, result.diagnosis) == (False, "exception"), result


# ---------------------------------------------------------------- the student's values, not the course's bug

@pytest.mark.parametrize("output, diagnosis", [
    (lambda query: torch.empty(query.transpose(1, 2).shape, device="meta"), "device"),
    (lambda query: torch.zeros(()).expand(2 ** 14, 2 ** 14), "shape"),
], ids=["meta tensor", "an expanded view of 2^28 numbers"])
def test_odd_tensors_returned_are_the_students_verdict(output, diagnosis):
    """7.2 computed with them before it looked at their shape (and asked a meta tensor for its numbers)."""
    def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        return output(query), None
    result = checks.check_hf_attention(attention_forward, graded=False)
    assert (result.passed, result.diagnosis) == (False, diagnosis), result


def test_a_prediction_on_the_meta_device_is_not_numbers():
    result = checks.check_toy_prediction(torch.empty(3, device="meta"), torch.tensor(1.0), graded=False)
    assert (result.passed, result.diagnosis) == (False, "dtype"), result


# ---------------------------------------------------------------- what a student's code switches, put back

def _settings():
    return (list(warnings.filters), sys.getrecursionlimit(), list(sys.path), gc.isenabled(),
            torch.backends.mkldnn.enabled, torch._tensor_str.PRINT_OPTS.precision, logging.root.manager.disable,
            signal.getsignal(signal.SIGINT))


def test_interpreter_settings_a_students_code_switches_are_put_back(check_process):
    def switching(q, k, v, mask=None):
        warnings.simplefilter("ignore")
        sys.setrecursionlimit(123456)
        sys.path.append("/nowhere")
        gc.disable()
        torch.backends.mkldnn.enabled = False
        torch.set_printoptions(precision=9)
        logging.disable(logging.CRITICAL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C would no longer stop the kernel
        return _attention(q, k, v, mask)
    before = _settings()
    try:
        assert checks.check_scaled_dot_product_attention(switching, graded=False).passed
        assert _settings() == before
    finally:   # a failure above must not leave this test process so
        signal.signal(signal.SIGINT, before[-1])
        gc.enable()


# ---------------------------------------------------------------- a signal that lands in the check's watcher

@pytest.mark.parametrize("signal_raised", [run.CheckTimeout, KeyboardInterrupt], ids=["time limit", "Ctrl-C"])
def test_a_signal_landing_in_the_checks_watcher_is_that_signal(signal_raised, monkeypatch):
    """The guard watches calls with a profile function; the time limit or Ctrl-C raised while it runs makes Python
    unset it. That is the signal's doing: the verdict is the time limit's, and Ctrl-C stops the check."""
    monkeypatch.setenv("COURSE_CHECK_IN_PROCESS", "1")   # the watcher of this very process
    calls = raise_once_in_the_watcher(monkeypatch, lambda: helper.__code__, signal_raised)

    def helper(n):
        return torch.ones(n, n, dtype=torch.bool).tril()

    def causal_mask(n):
        return helper(n)
    if signal_raised is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            checks.check_causal_mask(causal_mask, graded=False)
    else:
        result = checks.check_causal_mask(causal_mask, graded=False)
        assert result.diagnosis == "timeout", result
    assert calls and sys.getprofile() is None
    assert checks.check_causal_mask(lambda n: torch.ones(n, n, dtype=torch.bool).tril(), graded=False).passed


def test_interpreter_objects_a_students_code_replaces_come_back_as_they_were(check_process):
    """Not the same contents in another object: the kernel's own list of paths, of warning filters, its print
    options, its logging root."""
    import copy
    objects = (sys.path, warnings.filters, torch._tensor_str.PRINT_OPTS, logging.root)

    def replacing(q, k, v, mask=None):
        sys.path = [*sys.path, "/nowhere"]
        warnings.filters = []
        torch._tensor_str.PRINT_OPTS = copy.copy(torch._tensor_str.PRINT_OPTS)
        logging.root = logging.RootLogger(logging.WARNING)
        return _attention(q, k, v, mask)
    try:
        assert checks.check_scaled_dot_product_attention(replacing, graded=False).passed
        assert all(now is then for now, then in zip(
            (sys.path, warnings.filters, torch._tensor_str.PRINT_OPTS, logging.root), objects))
    finally:
        sys.path, warnings.filters, torch._tensor_str.PRINT_OPTS, logging.root = objects
