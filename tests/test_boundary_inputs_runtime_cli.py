"""Boundary checks found by a fault run (F3): runtime numbers, the command line's folders and options,
the autograder's paths, the pictures' inputs and the hosted set-up. Each case is refused at the public
function (or command) with a message naming the argument, what was expected and what was given."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from course_lib import corpora, hosted_setup, runtime, viz
from course_lib.classroom import assignments
from course_lib.classroom.grading import autograder
from course_lib.classroom.grading import cli as grading_cli


@pytest.fixture
def no_real_threads(monkeypatch):
    """torch.set_num_threads replaced by a recorder: before the fix a huge count crashed the process
    (segfault), so a regression fails here as an assertion, not as a dead test run."""
    asked: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    return asked


# ---------------------------------------------------------------------------------------------- G06 threads

@pytest.mark.parametrize("count", [100_000, 10**6, 2**31])
def test_set_threads_refuses_more_threads_than_the_machine_can_take(no_real_threads, count):
    with pytest.raises(ValueError, match=rf"count: expected 1 to \d+ threads \(this machine has \d+ cores\), "
                                         rf"got {count}"):
        runtime.set_threads(count)
    assert no_real_threads == []


def test_choose_threads_and_course_threads_refuse_huge_counts(no_real_threads, monkeypatch):
    with pytest.raises(ValueError, match="candidates: expected 1 to .* got 1000000"):
        runtime.choose_threads([1, 10**6])
    monkeypatch.setenv("COURSE_THREADS", "100000")
    with pytest.raises(ValueError, match="COURSE_THREADS: expected 1 to .* got 100000"):
        runtime.course_threads()
    assert 100_000 not in no_real_threads and 10**6 not in no_real_threads


def test_set_threads_takes_numpy_ints(no_real_threads):
    runtime.set_threads(np.int64(1))
    assert no_real_threads == [1] and type(no_real_threads[0]) is int


def test_bench_threads_refuses_a_huge_count_in_one_line(no_real_threads, capsys):
    from course_lib.__main__ import main
    assert main(["bench", "attention", "--threads", "100000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: threads: expected 1 to ") and "got 100000" in err
    assert no_real_threads == []


# ------------------------------------------------------------------------------------- G08 runtime numbers

@pytest.mark.parametrize("seconds", [float("inf"), 1e308])
def test_expect_time_refuses_times_that_overflow(seconds, monkeypatch):
    monkeypatch.setattr(runtime, "slowdown", lambda: 1.0)
    with pytest.raises(ValueError, match="reference_seconds: expected"):
        runtime.expect_time(seconds, "x")


@pytest.mark.parametrize("seconds", [float("inf"), 1e308])
def test_calibrate_refuses_a_time_that_never_ends(seconds, monkeypatch):
    class Clock:   # before the fix the loop never ended: fail instead of hanging
        calls = 0

        @classmethod
        def perf_counter(cls):
            cls.calls += 1
            if cls.calls > 1000:
                raise AssertionError("calibrate(inf) started an endless measurement")
            return float(cls.calls)
    monkeypatch.setattr(runtime, "time", Clock)
    with pytest.raises(ValueError, match="seconds: expected"):
        runtime.calibrate(seconds)


@pytest.mark.parametrize("call", [lambda: runtime.set_seed(2**64), lambda: runtime.setup_notebook(seed=2**70)])
def test_seeds_beyond_64_bits_are_named(call):
    with pytest.raises(ValueError, match=r"seed: expected an int >= 0 and below 2\*\*64, got"):
        call()


def test_set_seed_takes_numpy_ints():
    a = torch.rand(3, generator=runtime.set_seed(np.int64(3)))
    b = torch.rand(3, generator=runtime.set_seed(3))
    assert torch.equal(a, b)


# --------------------------------------------------------------------------- G10 the option or variable named

def test_train_resume_of_a_file_names_resume(tmp_path, capsys):
    from course_lib.__main__ import main
    file = tmp_path / "file.txt"
    file.write_text("not a run")
    assert main(["train", "--resume", str(file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: resume: expected a run folder") and "--out" not in err


def test_a_course_device_torch_cannot_read_is_named(monkeypatch):
    monkeypatch.setenv("COURSE_DEVICE", "cpu:abc")
    with pytest.raises(ValueError, match=r"COURSE_DEVICE: expected 'cpu', 'cuda', 'cuda:N' or 'mps', got 'cpu:abc'"):
        runtime.device()


def test_train_steps_beyond_any_run_are_refused(tmp_path):
    from course_lib.runs.presets import RunRequest
    from course_lib.runs.run_folder import RunRefused
    with pytest.raises(RunRefused, match="steps: expected a positive int up to 1,000,000,000, got "
                                         "99999999999999999999"):
        RunRequest("tiny", tmp_path / "run", steps=99999999999999999999)


# ---------------------------------------------------------------------------------- G05 empty folder paths

@pytest.mark.parametrize("command, argv, name", [
    (assignments.start_main, [""], "dir"),
    (assignments.main, ["", "OUT"], "src"),
    (assignments.main, ["SRC", ""], "out"),
])
def test_an_empty_folder_is_refused_not_read_as_the_current_one(tmp_path, monkeypatch, capsys, command, argv, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "SRC").mkdir()
    assert command(argv) == 2
    assert capsys.readouterr().err.strip() == f"error: {name}: expected a folder, got an empty string"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SRC"], "nothing written into the current folder"


# ------------------------------------------------------------------------------------ G09 autograder paths

def test_an_archive_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys):
    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(autograder, "_course_wheel", lambda folder: None)
    monkeypatch.setattr(autograder.zipfile, "ZipFile", refuse)
    assert autograder.main([str(tmp_path / "a.zip")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: out: could not write ") and "Permission denied" in err


def test_run_autograder_refuses_a_root_that_is_no_folder(tmp_path):
    with pytest.raises(NotADirectoryError, match="root: expected Gradescope's /autograder folder .* \\(missing\\)"):
        autograder.run_autograder(tmp_path / "nope")
    assert not (tmp_path / "nope").exists(), "no results/ made up for a missing root"
    file = tmp_path / "file.txt"
    file.write_text("x")
    with pytest.raises(NotADirectoryError, match="root: .* \\(a file\\)"):
        autograder.run_autograder(file)


def test_the_autograder_command_refuses_a_file_root_in_one_line(tmp_path):
    file = tmp_path / "file.txt"
    file.write_text("x")
    ran = subprocess.run([sys.executable, "-m", "course_lib.classroom.grading.autograder", str(file)],
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert ran.stderr.startswith("error: root: expected Gradescope's /autograder folder")


# ---------------------------------------------------------------------------------- G15 exercise ids

@pytest.mark.parametrize("command", ["autograder", "grade"])
def test_exercises_say_what_an_id_looks_like(command, tmp_path, capsys):
    """'²' is a digit to str.isdigit but not to int(): it was argparse's "invalid exercise_ids value"."""
    argv = [str(tmp_path / "a.zip")] if command == "autograder" else [str(tmp_path), "--out", str(tmp_path / "r")]
    main = autograder.main if command == "autograder" else grading_cli.main
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--exercises", "²"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "invalid exercise_ids value" not in err
    assert "notebook numbers (01 to" in err and "got '²'" in err


# ----------------------------------------------------------------------------------------------- G12 viz

W = torch.softmax(torch.randn(4, 4), dim=-1)


@pytest.mark.parametrize("weights, error, words", [
    (W.to("meta"), ValueError, "weights: expected a tensor holding numbers, got a tensor on the meta device"),
    (W.to_sparse(), TypeError, "weights: expected a dense tensor, got a torch.sparse_coo tensor"),
    (W.to(torch.complex64), TypeError, "weights: expected real numbers"),
])
def test_plot_attention_refuses_tensors_without_plain_numbers(weights, error, words):
    with pytest.raises(error, match=words.replace(".", r"\.")):
        viz.plot_attention(weights)


@pytest.mark.parametrize("call", [
    lambda fn: viz.playground_samples(fn, "", [(1.0, None)]),
    lambda fn: viz.generation_playground(fn, static=True),
])
def test_a_generate_fn_of_the_wrong_shape_is_named_before_it_is_called(call):
    with pytest.raises(TypeError, match=r"generate_fn: expected a function \(prompt, temperature, top_k, "
                                        r"max_new_tokens\) -> str .* got <lambda>\(p\)"):
        call(lambda p: p)


def test_query_explorer_refuses_keys_too_large_to_draw():
    with pytest.raises(ValueError, match="keys: expected numbers of size at most 1e\\+06 .* got one of size 1e\\+30"):
        viz.plot_query_explorer(90, keys=[[1e30, 1e30], [1e30, -1e30], [0.0, 1.0]])


@pytest.mark.parametrize("static", ["yes", 1])
def test_static_must_be_a_bool(static):
    with pytest.raises(TypeError, match="static: expected True or False, got"):
        viz.query_explorer(static=static)
    with pytest.raises(TypeError, match="static: expected True or False, got"):
        viz.generation_playground(lambda *a: "x", static=static)


def test_the_softmax_advice_is_given_only_for_attention_weights():
    nan = [[float("nan"), 1.0], [0.0, 1.0]]
    with pytest.raises(ValueError, match="plot the weights after the softmax"):
        viz.plot_attention(torch.tensor(nan))
    with pytest.raises(ValueError) as raised:
        viz.plot_query_explorer(90, keys=nan)
    assert str(raised.value).startswith("keys: expected finite numbers") and "softmax" not in str(raised.value)


# ----------------------------------------------------------------------------------- G14 hosted set-up

def test_finish_refuses_an_empty_torch_version(capsys):
    with pytest.raises(ValueError, match="torch_before: expected a version string .* got an empty string"):
        hosted_setup.finish([], download=False, torch_before="")
    assert "WARNING" not in capsys.readouterr().out


def test_widget_mode_says_environment_values_are_text():
    with pytest.raises(TypeError, match=r"environ\['COURSE_STATIC_WIDGETS'\]: expected a str"):
        hosted_setup.widget_mode("local", environ={"COURSE_STATIC_WIDGETS": 1})


@pytest.mark.parametrize("call", [lambda: corpora.corpus_path("names", download="yes"),
                                  lambda: corpora.load_corpus("names", download=None)])
def test_download_must_be_a_bool(call):
    with pytest.raises(TypeError, match="download: expected True or False, got"):
        call()


def test_a_data_dir_naming_no_user_is_named(monkeypatch):
    monkeypatch.setenv("COURSE_DATA_DIR", "~nosuchuser_f3/x")
    with pytest.raises(ValueError, match="COURSE_DATA_DIR: expected a folder path, got '~nosuchuser_f3/x'"):
        corpora.corpus_path("names", download=False)
