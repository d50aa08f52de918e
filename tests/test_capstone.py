"""Notebook 08's machinery: side-by-side training of collected parts, the 8.1 verdict, and the blame."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

from course_lib.classroom import capstone, checks
from course_lib.classroom.assignments import update_learner_copies
from course_lib.classroom.capstone import TrainingRun, TrainingSetup, find_blame, train_parts
from course_lib.classroom.collect import Collection, collect_student_parts, course_exercises
from course_lib.classroom.training_runs import judge
from course_lib.model import GPTConfig

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
TRAIN_RECORD = ROOT / "build" / "train-record"   # what `make notebooks` recorded (Makefile: train once)
REPLAY_HOOK = ROOT / "tests" / "train_replay_hook"


def _tiny_setup(steps: int = 60) -> TrainingSetup:
    """A repetitive token stream a tiny GPT learns in a few dozen steps; no corpus needed."""
    ids = torch.arange(4000) % 7                                                   # 0 1 2 ... 6 0 1 ...
    config = GPTConfig(vocab_size=7, embed_dim=16, num_heads=2, num_layers=1, max_tokens=8, dropout_rate=0.1)

    def batches(generator):
        starts = torch.randint(len(ids) - 9, (16,), generator=generator)           # (16,)
        windows = torch.stack([ids[s:s + 9] for s in starts.tolist()])             # (16, 9)
        return windows[:, :-1], windows[:, 1:]

    val = torch.stack([ids[s:s + 9] for s in range(0, 400, 9)])
    return TrainingSetup("tiny", config, batches, val[:, :-1], val[:, 1:], steps, eval_every=20)


def _solution_source(exercise_id: str, old: str, new: str) -> str:
    exercise = course_exercises()[exercise_id]
    assert old in exercise.solution, f"the planted edit no longer matches exercise {exercise_id}'s solution"
    return exercise.solution.replace(old, new)


DROPOUT_ON_SCORES = ('        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))\n'
                     '        weights = self.attn_dropout(torch.softmax(scores, dim=-1))',
                     '        scores = self.attn_dropout(scores.masked_fill(~self.mask[:length, :length], '
                     'float("-inf")))\n        weights = torch.softmax(scores, dim=-1)')
NO_SCALE = (" / self.head_dim ** 0.5", "")


@pytest.fixture(scope="module")
def solutions():
    return collect_student_parts(ROOT / "notebooks")


@pytest.mark.slow
def test_correct_parts_train_exactly_like_the_reference(solutions):
    setup = _tiny_setup()
    reference = train_parts(solutions, [], setup, label="reference")
    yours = train_parts(solutions, None, setup)
    assert reference.failure is None and reference.final_val_loss < reference.train_loss[0] - 0.5, "it learns"
    assert yours.val_loss == reference.val_loss, "same code, same start, same batches: the same numbers"
    assert judge(yours, reference).passed
    # the check knows the two runs apart by how train_parts was asked for them, not by their numbers (equal here)
    assert checks.check_trains_like_reference(yours, reference).passed
    assert yours.trained_on == reference.trained_on == (setup.name, setup.seed, setup.learning_rate)
    for mine, theirs, words in ((reference, yours, "your run first"), (yours, yours, "same run"),
                                (reference, reference, "same run"), (yours, dataclasses.replace(
                                    yours, yours_asked=("2.1",), not_yours=None), "trained your parts")):
        verdict = checks.check_trains_like_reference(mine, theirs)
        assert (verdict.passed, verdict.diagnosis) == (False, "exception") and words in verdict.message


def test_dropout_on_the_masked_scores_is_nan_in_training_and_blamed_on_3_3(solutions):
    planted = solutions.with_part("3.3", _solution_source("3.3", *DROPOUT_ON_SCORES))
    setup = _tiny_setup()
    yours = train_parts(planted, None, setup)
    verdict = judge(yours, train_parts(planted, [], setup))
    assert yours.failure == "nan" and not verdict.passed and verdict.diagnosis == "nan"
    blame = find_blame(planted, setup)
    assert blame is not None and (blame.exercise, blame.verdict) == ("3.3", "nan")
    said = str(blame)
    assert said.startswith("Exercise 3.3 (MultiHeadMaskedAttention): with your MultiHeadMaskedAttention, "
                           "the loss becomes NaN at step 1.")
    assert "dropout applied before the softmax" in said
    assert "Fix it in 03_multi_head_attention.ipynb, save it, and run this notebook again" in said
    demo = find_blame(planted, setup, only=["3.3"], whose="the planted")
    assert str(demo).startswith("Exercise 3.3 (MultiHeadMaskedAttention): with the planted ") and "Fix it" not in str(demo)
    assert find_blame(planted, setup, only=["2.1"]) is None, "only= limits the parts tried"


def test_a_missing_scale_is_judged_behind_and_blamed(solutions):
    planted = solutions.with_part("3.3", _solution_source("3.3", *NO_SCALE))
    setup = _tiny_setup(steps=80)
    reference = train_parts(planted, [], setup)
    yours = train_parts(planted, None, setup)
    assert yours.failure is None and yours.val_loss != reference.val_loss
    blame = find_blame(planted, setup, steps=80, tolerance=0.0)
    assert blame is not None and blame.exercise == "3.3"


def test_a_training_step_that_raises_ends_in_a_verdict_not_a_crash(solutions):
    broken = solutions.with_part("5.3", "def train_step(model, optimizer, inputs, targets, max_grad_norm=1.0):\n"
                                        "    raise RuntimeError('oops')\n")
    setup = _tiny_setup()
    yours = train_parts(broken, None, setup)
    assert yours.failure == "exception: RuntimeError: oops"
    verdict = judge(yours, train_parts(broken, [], setup))
    assert not verdict.passed and verdict.diagnosis == "exception"
    assert find_blame(broken, setup).verdict == "raises"


def test_judge_verdicts_on_recorded_runs():
    reference = TrainingRun("reference", [1, 2], [3.0, 2.0], [2], [1.5])
    assert judge(TrainingRun("y", [1, 2], [3.0, 2.0], [2], [1.51]), reference).passed
    behind = judge(TrainingRun("y", [1, 2], [3.0, 2.0], [2], [1.6]), reference)
    assert not behind.passed and behind.diagnosis == "mismatch" and "1.600" in behind.message
    ahead = judge(TrainingRun("y", [1, 2], [3.0, 2.0], [2], [1.45]), reference)
    assert not ahead.passed and ahead.diagnosis == "mismatch" and "BELOW" in ahead.message
    assert "less dropout" in ahead.message and "So far below" not in ahead.message   # a dropout left out
    leaks = judge(TrainingRun("y", [1, 2], [3.0, 2.0], [2], [0.05]), reference)
    assert not leaks.passed and "So far below, it sees what it predicts" in leaks.message   # a mask that leaks
    stalled = judge(TrainingRun("y", [1, 2], [3.0, 3.0], [2], [3.0]), reference)
    assert not stalled.passed and "does not go down" in stalled.message
    with pytest.raises(TypeError, match="yours: expected a TrainingRun"):
        judge({"val_loss": [1.0]}, reference)
    with pytest.raises(ValueError, match="reference: the reference run itself failed"):
        judge(reference, TrainingRun("r", failure="nan"))


def test_arguments_are_checked(solutions):
    with pytest.raises(TypeError, match="collection: expected the result of collect_student_parts"):
        train_parts("notebooks", None, _tiny_setup())
    with pytest.raises(TypeError, match="setup: expected names_setup"):
        train_parts(solutions, None, "names")
    with pytest.raises(ValueError, match="steps: expected a positive int"):
        train_parts(solutions, None, _tiny_setup(), steps=0)
    with pytest.raises(ValueError, match="source: does not compile"):
        solutions.with_part("3.3", "class (")


@pytest.mark.slow
def test_the_learner_copy_of_notebook_08_blames_a_planted_part(tmp_path):
    """The notebook as a student runs it: their copies in one folder, one part with a classic mistake."""
    folder = tmp_path / "student"
    update_learner_copies(ROOT / "notebooks", folder)
    exercise = course_exercises()["3.3"]
    path = folder / exercise.notebook
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if c.get("id") == exercise.cell_id)
    cell.source = _solution_source("3.3", *DROPOUT_ON_SCORES) + '\n\nprint("MultiHeadMaskedAttention defined")\n'
    nbformat.write(nb, path)

    # One thread: the suite runs on two xdist workers, and a kernel with two threads beside the other worker
    # made them wait on each other (338 s instead of 47 s). Nothing below depends on the thread count.
    env = dict(os.environ, COURSE_DATA_DIR=str(SHARED), COURSE_THREADS="1", MPLBACKEND="Agg",
               COURSE_STATIC_WIDGETS="1")
    # `make test` runs the solution notebooks first, which record their trainings (course_lib/train_replay.py):
    # the reference run here is that same training (the same parts' code, data and settings), so it is replayed
    # rather than trained again. The planted part's code differs, so its run (and each blame trial) trains for
    # real; without a record everything trains.
    if TRAIN_RECORD.is_dir():
        env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPLAY_HOOK), os.environ.get("PYTHONPATH")])),
                   COURSE_TRAIN_REPLAY=str(TRAIN_RECORD))
    done = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                           "--output", "08_ran", "08_train_your_gpt.ipynb"], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    ran = json.loads((folder / "08_ran.ipynb").read_text(encoding="utf-8"))
    printed = "".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                      for c in ran["cells"] if c["cell_type"] == "code" for o in c["outputs"])
    assert re.search(r"3\.3\s+MultiHeadMaskedAttention\s+yours", printed), "the table shows the planted part"
    assert "Exercise 8.1: NOT YET (nan)" in printed
    assert "Exercise 3.3 (MultiHeadMaskedAttention): with your MultiHeadMaskedAttention, the loss becomes NaN" \
        in printed.split("Nothing to blame")[0], "the blame cell names the planted part"


def test_the_side_by_side_figure_draws_both_runs(solutions):
    setup = _tiny_setup(steps=20)
    reference = train_parts(solutions, [], setup, label="reference")
    yours = train_parts(solutions, None, setup, label="yours")
    fig = capstone.plot_side_by_side(yours, reference, title="tiny")
    labels = [line.get_label() for line in fig.axes[0].lines]
    assert labels == ["reference, training batches", "reference, validation", "yours, training batches",
                      "yours, validation"]
    assert fig._repr_png_()[:4] == b"\x89PNG", "the figure shows itself in a notebook"
    with pytest.raises(TypeError, match="reference: expected a TrainingRun"):
        capstone.plot_side_by_side(yours, None)


@pytest.mark.slow
def test_names_are_sampled_one_per_boundary_token(solutions):
    ids = torch.tensor([0, 1, 2, 3, 0] * 400)                                  # ".abc." repeated: one name, "abc"
    config = GPTConfig(vocab_size=4, embed_dim=16, num_heads=2, num_layers=1, max_tokens=8)

    def batches(generator):
        starts = torch.randint(0, 395, (16,), generator=generator) // 5 * 5    # (16,): every window starts at "."
        windows = torch.stack([ids[s:s + 9] for s in starts.tolist()])         # (16, 9)
        return windows[:, :-1], windows[:, 1:]

    val = torch.stack([ids[s:s + 9] for s in range(0, 100, 5)])
    setup = TrainingSetup("abc", config, batches, val[:, :-1], val[:, 1:], 150, eval_every=50,
                          decode=lambda t: "".join(".abc"[i] for i in t), start_token=0)
    run = train_parts(solutions, [], setup)
    names = capstone.sample_names(run, setup, count=5, seed=0, temperature=0.5)
    assert names == ["abc"] * 5, names


@pytest.mark.slow
def test_a_learner_copy_with_none_of_its_parts_is_not_implemented(solutions):
    """Issue 27: with the course's parts standing in for the student's, both runs are the same code;
    8.1 must say not_implemented (as the grader does), never a green 'trains like the reference'."""
    blank = Collection(solutions.folder, {ex: dataclasses.replace(part, status="unfinished", source=None)
                                          for ex, part in solutions.parts.items()})
    assert blank.yours() == []
    setup = _tiny_setup(steps=20)
    reference = train_parts(blank, [], setup, label="reference")
    yours = train_parts(blank, None, setup, label="yours")
    assert yours.val_loss == reference.val_loss, "the same code: a pass would be trivial"
    verdict = judge(yours, reference)
    assert not verdict.passed and verdict.diagnosis == "not_implemented", verdict
    assert "9 of 9" in verdict.message and "2.1 (course's (yours is not written yet))" in verdict.message
    checked = checks.check_trains_like_reference(yours, reference, graded=False)
    assert not checked.passed and checked.diagnosis == "not_implemented"
    assert judge(train_parts(solutions, None, setup), reference).passed, "all parts the student's: judged"


@pytest.mark.slow
def test_blame_lengthens_a_run_that_shows_no_lag_and_says_whether_the_part_lags_alone(solutions, monkeypatch):
    """Issue 20: blame trained shorter than 8.1 and answered 'only together' for a lag one part made.
    Here the short runs are made to show no lag: the blame must come from a run as long as 8.1's."""
    equivalent_mask = _solution_source("2.1", ".tril()", ".tril(diagonal=0)")      # the student's own, right
    planted = solutions.with_part("2.1", equivalent_mask).with_part("3.3", _solution_source("3.3", *NO_SCALE))
    setup = _tiny_setup(steps=80)   # as the missing-scale test above: at 80 steps the lag shows
    real = capstone.how_it_fails
    monkeypatch.setattr(capstone, "how_it_fails",
                        lambda run, ref, tol: real(run, ref, tol) if len(run.step) == setup.steps else None)
    blame = find_blame(planted, setup, steps=20, tolerance=0.0)
    assert blame is not None and blame.exercise == "3.3", blame
    assert len(blame.run.step) == setup.steps, "the lag was found at 8.1's length"
    assert blame.earlier == ("2.1",) and blame.alone is True
    assert "This part alone" in str(blame) and "together" not in str(blame)
