"""setup_notebook compares this machine with the reference laptop; expect_time scales a run's stated time."""
from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest
import torch

from course_lib import runtime

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def speed(monkeypatch):
    """Pretend this machine is `factor` times slower than the reference laptop."""
    def set_factor(factor: float) -> None:
        monkeypatch.setitem(runtime._state, "slowdown", factor)
    return set_factor


def test_calibration_measures_matmul_speed_quickly_and_leaves_the_random_stream_alone():
    before = torch.random.get_rng_state()
    import time
    start = time.perf_counter()
    gflops = runtime.calibrate(seconds=0.05)
    assert time.perf_counter() - start < 5   # a fraction of a second, even on a busy machine
    assert gflops > 0 and runtime.slowdown() == pytest.approx(runtime.REFERENCE_GFLOPS / gflops)
    assert torch.equal(torch.random.get_rng_state(), before), "the notebook's seeded stream must not move"
    with pytest.raises(ValueError, match="seconds"):
        runtime.calibrate(seconds=0)


@pytest.mark.parametrize("factor, wanted", [
    (2.4, "about 2.4x slower than the reference laptop"),
    (13.6, "about 14x slower than the reference laptop"),
    (0.5, "about 2.0x faster than the reference laptop"),
    (402.0, "more than 20x slower than the reference laptop right now"),
    (1.1, "about as fast as the reference laptop"),
])
def test_setup_notebook_prints_one_line_comparing_this_machine(capsys, monkeypatch, speed, factor, wanted):
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    # the count it has: a crowded machine's thread choice is tested in test_runtime.py
    monkeypatch.setenv("COURSE_THREADS", str(torch.get_num_threads()))
    speed(factor)
    runtime.setup_notebook(seed=3)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].endswith("seed 3")
    assert lines[1].startswith(f"this machine: {wanted} (2 quiet CPU cores)")


def test_a_busy_machine_is_told_what_may_help(capsys, monkeypatch, speed):
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    torch_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        speed(8.0)
        print(runtime._compare_with_reference(torch.device("cpu")))
        torch.set_num_threads(1)
        print(runtime._compare_with_reference(torch.device("cpu")))
    finally:
        torch.set_num_threads(torch_threads)
    two, one = capsys.readouterr().out.splitlines()
    assert "COURSE_THREADS=1" in two and "COURSE_THREADS" not in one
    assert "runs on cuda" in runtime._compare_with_reference(torch.device("cuda"))


def test_expect_time_scales_the_reference_time_and_says_so_before_the_run(capsys, speed):
    speed(3.0)
    assert runtime.expect_time(80, "2,000 steps on Shakespeare") == pytest.approx(240)
    assert capsys.readouterr().out == ("2,000 steps on Shakespeare: about 80 s on the reference laptop; "
                                       "expected on this machine: about 240 s (4 minutes)\n")
    speed(0.5)
    assert runtime.expect_time(30, "x") == pytest.approx(15)
    capsys.readouterr()
    speed(400.0)
    runtime.expect_time(30, "x")
    assert capsys.readouterr().out.endswith("expected on this machine: more than 600 s (10 minutes)\n")
    with pytest.raises(ValueError, match="reference_seconds"):
        runtime.expect_time(0, "a run")
    with pytest.raises(TypeError, match="what"):
        runtime.expect_time(10, " ")


def _sanitized(text: str) -> str:
    config = configparser.ConfigParser(interpolation=None)   # as nbval reads it
    config.read(ROOT / "tests" / "nbval_sanitize.cfg")
    for section in config.sections():
        text = re.sub(config[section]["regex"], config[section]["replace"], text)
    return text


def test_nbval_sees_the_same_output_on_any_machine(capsys, monkeypatch, speed):
    """A notebook's stored first output stays valid on a faster, slower or busier machine."""
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    monkeypatch.setenv("COURSE_THREADS", "2")   # as the notebook runs set it: then threads are never measured
    outputs = []
    for factor in (0.3, 1.0, 2.4, 400.0):
        speed(factor)
        runtime.setup_notebook()
        runtime.expect_time(80, "the run")
        outputs.append(_sanitized(capsys.readouterr().out))
    assert len(set(outputs)) == 1, outputs
    assert "this machine: SPEED" in outputs[0]
