"""A third fault run's wrong calls to the checks and the classroom's functions: each is the student's (or the
instructor's) slip, answered by a verdict or an error that names what was given, never a crash inside the course
or a message about something else. Every row failed before its fix."""
from __future__ import annotations

import pytest
import torch

from course_lib import train as train_ref
from course_lib.attention import MaskedAttention
from course_lib.classroom import capstone, checks, collect, doctor, progress, training_runs
from course_lib.classroom.checks.engine import run
from course_lib.model import GPT, GPTConfig, TransformerBlock

_CONFIG = GPTConfig(vocab_size=5, max_tokens=8, embed_dim=8, num_heads=2, num_layers=1)


def _meta_tensor(*args, **kwargs):
    return torch.zeros(3, device="meta")   # "a class" whose constructor is a function returning a tensor


class _SetsTheDefaultDtype(MaskedAttention):
    """Its forward returns its input, after changing torch's default dtype: that made the reference's inputs
    float64 and the verdict "a bug in the course"."""

    def forward(self, x):
        torch.set_default_dtype(torch.float64)
        return x


def _flops_plus_a_half(config, num_weights):
    return 6 * num_weights + 12 * config.num_layers * config.embed_dim * config.max_tokens + 0.5


# (the call, the diagnosis, words of the message, words it must not hold)
VERDICTS = [
    (lambda: checks.check_train_step(None), "exception", "function train_step itself", "is not callable"),
    (lambda: checks.check_sampling(42), "exception", "function sample_next_token itself", "is not callable"),
    (lambda: checks.check_kv_cache("x"), "exception", "function generate_with_cache itself", "is not callable"),
    (lambda: checks.check_transformer_block(TransformerBlock(16, 2, 8)), "exception", "pass the class itself",
     "norm_first"),
    (lambda: checks.check_gpt(GPT(_CONFIG)), "exception", "pass the class itself", "GPTConfig"),
    (lambda: checks.check_gpt(None), "exception", "class GPT itself", "`cls`"),
    (lambda: checks.check_masked_attention(_meta_tensor), "exception", "should build an nn.Module, but gave a tensor",
     "device of the inputs"),
    (lambda: checks.check_rms_norm(_meta_tensor), "exception", "should build an nn.Module, but gave a tensor",
     "device of the inputs"),
    (lambda: checks.check_masked_attention(_SetsTheDefaultDtype), "global_setting",
     "torch.get_default_dtype() was torch.float32, is now torch.float64", "bug in the course"),   # and put back
    (lambda: checks.check_flops_per_token(_flops_plus_a_half), "attention_flops", "2,663,424.5", "returned 2,663,424,"),
    (lambda: checks.check_flops_per_token(lambda config, n: 10 ** 400), "shape", "401 digits", "OverflowError"),
]


@pytest.mark.parametrize("call, diagnosis, says, avoids", VERDICTS)
def test_a_wrong_argument_to_a_check_is_a_verdict_that_names_it(call, diagnosis, says, avoids):
    before = torch.get_default_dtype()
    result = call()
    assert torch.get_default_dtype() == before   # put back, whatever the student's code did
    assert not result.passed and result.diagnosis == diagnosis, result
    assert says in result.message and avoids not in result.message, result.message


def _room_table():
    return progress.room_table(None)


# (the call, the exception, words of its message)
REFUSED = [
    (lambda: collect.collect_student_parts("notebooks", exercises=None), TypeError, "exercises: expected a list"),
    (lambda: collect.collect_student_parts("notebooks", notebooks="x"), TypeError, "notebooks: expected a list"),
    (lambda: collect.course_exercises(notebooks=5), TypeError, "notebooks: expected a list of notebook paths"),
    (lambda: collect.course_exercises(notebooks=["missing.ipynb"]), FileNotFoundError, "'missing.ipynb' (not found)"),
    (lambda: capstone.names_setup(steps="10"), ValueError, "steps: expected a positive int, got '10'"),
    (lambda: capstone.names_setup(steps=0), ValueError, "steps: expected a positive int"),
    (lambda: capstone.shakespeare_setup(steps=1.5), ValueError, "steps: expected a positive int"),
    (_room_table, TypeError, "room: expected a Room"),
    (lambda: doctor.run_doctor(stream="x"), TypeError, "stream: expected a text stream"),
    (lambda: training_runs.how_it_fails(training_runs.TrainingRun("a"), training_runs.TrainingRun("b"), "x"),
     ValueError, "tolerance: expected a finite number >= 0"),
    (lambda: training_runs.judge(training_runs.TrainingRun("a", [1], [2.0], [1], [2.0]),
                                 training_runs.TrainingRun("b", [1], [2.0], [1], [2.0]), -1),
     ValueError, "tolerance: expected a finite number >= 0"),
    (lambda: run.set_time_limit(float("inf")), ValueError, "seconds: expected a finite number"),
    (lambda: run.set_time_limit(1e12), ValueError, "seconds: expected at most 86,400 seconds"),
]


@pytest.mark.parametrize("call, error, says", REFUSED)
def test_a_wrong_argument_to_the_classroom_is_refused_by_name(call, error, says):
    with pytest.raises(error, match=None) as raised:
        call()
    assert says in str(raised.value), str(raised.value)


def test_train_parts_refuses_parts_that_are_not_exercise_ids():
    parts = collect.collect_student_parts("notebooks")
    setup = capstone.names_setup(steps=2)
    for yours, error, says in (("2.2", TypeError, "yours: expected a list"), (["99.9"], ValueError, "'99.9'")):
        with pytest.raises(error) as raised:
            capstone.train_parts(parts, yours, setup)
        assert says in str(raised.value), str(raised.value)


@pytest.mark.parametrize("value", ["abc", "", "0", "-1", "nan", "inf", "1e12"])
def test_a_time_limit_from_the_environment_is_a_number_of_seconds(value, monkeypatch):
    monkeypatch.setenv("COURSE_CHECK_TIME_LIMIT", value)
    with pytest.raises(ValueError, match="COURSE_CHECK_TIME_LIMIT: expected"):
        run._time_limit_from_environment()


def test_the_course_count_of_flops_still_passes():
    assert checks.check_flops_per_token(lambda config, n: train_ref.flops_per_token(config, n)).diagnosis \
        == "calls_reference"   # the course's own is not the student's work; a count of one's own passes below
    own = lambda config, n: 6 * n + 12 * config.num_layers * config.embed_dim * config.max_tokens  # noqa: E731
    assert checks.check_flops_per_token(own).passed
