"""The first cell of every notebook: seeds, threads and the device, with messages naming the setting."""
import pytest
import torch

from course_lib import runtime


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_set_seed_makes_draws_repeat():
    first = torch.rand(3, generator=runtime.set_seed(7)), torch.rand(3)
    second = torch.rand(3, generator=runtime.set_seed(7)), torch.rand(3)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    with pytest.raises(ValueError, match="seed: expected an int >= 0"):
        runtime.set_seed(-1)


def test_course_threads_sets_the_thread_count(monkeypatch, restore_threads, capsys):
    wanted = 2 if torch.get_num_threads() != 2 else 1
    monkeypatch.setenv("COURSE_THREADS", str(wanted))
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    assert runtime.setup_notebook(seed=3) == torch.device("cpu")
    assert torch.get_num_threads() == wanted
    assert f"{wanted} CPU threads | seed 3" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["two", "1.5", "2 threads"])
def test_a_bad_course_threads_is_named(monkeypatch, restore_threads, value):
    monkeypatch.setenv("COURSE_THREADS", value)
    with pytest.raises(ValueError, match="COURSE_THREADS: expected a whole number of CPU threads"):
        runtime.setup_notebook()


def test_a_bad_course_device_is_named(monkeypatch):
    monkeypatch.setenv("COURSE_DEVICE", "tpu")
    with pytest.raises(ValueError, match=r"COURSE_DEVICE: expected one of \['cuda', 'mps', 'cpu'\]"):
        runtime.device()


# ---------------------------------------------------------------- threads on a crowded machine (issue 44)

@pytest.fixture
def crowded(monkeypatch):
    """A CPU that calibrates as 8x slower than the reference laptop, and small-op timings we choose."""
    monkeypatch.delenv("COURSE_THREADS", raising=False)
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    monkeypatch.setattr(runtime, "calibrate", lambda seconds=0.2: runtime._state.__setitem__("slowdown", 8.0))
    runtime._state["slowdown"] = 8.0
    timings = {}

    def fake_time(count, tensors, repeats, budget=0.25):
        torch.set_num_threads(count)
        return timings[count]
    monkeypatch.setattr(runtime, "_time_small_ops", fake_time)
    yield timings
    runtime._state.pop("slowdown", None)


def test_a_crowded_machine_gets_the_faster_thread_count_and_is_told_how_to_change_it(crowded, restore_threads,
                                                                                      capsys):
    torch.set_num_threads(2)
    crowded.update({1: 0.004, 2: 0.089})          # notebook 09's cell on a loaded machine: 4 s against 89 s
    runtime.setup_notebook(seed=1)
    assert torch.get_num_threads() == 1
    lines = capsys.readouterr().out.splitlines()
    assert "| 1 CPU threads |" in lines[0], "the summary line shows the count chosen"
    assert lines[-1].startswith("threads: 1 chosen") and "4.0 ms" in lines[-1] and "89.0 ms" in lines[-1]
    assert "course_lib.runtime.set_threads(2)" in lines[-1], "the way back, runnable mid-notebook"
    assert "COURSE_THREADS=1" not in "\n".join(lines), "no advice to restart once the choice is made"


def test_where_more_threads_are_faster_they_are_kept(crowded, restore_threads, capsys):
    torch.set_num_threads(2)
    crowded.update({1: 0.009, 2: 0.005})
    runtime.setup_notebook()
    assert torch.get_num_threads() == 2
    assert capsys.readouterr().out.splitlines()[-1].startswith("threads: 2 kept")


def test_course_threads_is_honoured_and_never_probed(crowded, monkeypatch, restore_threads, capsys):
    """nbval sets COURSE_THREADS=2: its runs must not depend on a measurement."""
    monkeypatch.setenv("COURSE_THREADS", "2")
    crowded.update({1: 0.001, 2: 1.0})            # 1 would win, were it measured
    runtime.setup_notebook()
    assert torch.get_num_threads() == 2
    out = capsys.readouterr().out
    assert "threads:" not in out and len(out.splitlines()) == 2


def test_a_quiet_machine_is_not_probed(monkeypatch, restore_threads, capsys):
    monkeypatch.delenv("COURSE_THREADS", raising=False)
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    monkeypatch.setitem(runtime._state, "slowdown", 1.0)
    monkeypatch.setattr(runtime, "choose_threads", lambda *a, **k: pytest.fail("probed a quiet machine"))
    threads = torch.get_num_threads()
    runtime.setup_notebook()
    assert torch.get_num_threads() == threads and len(capsys.readouterr().out.splitlines()) == 2


def test_choose_threads_measures_the_real_step_in_turns_and_leaves_the_random_stream_alone(restore_threads):
    torch.set_num_threads(2)
    before = torch.random.get_rng_state()
    choice = runtime.choose_threads(repeats=2)
    assert torch.get_num_threads() == choice.chosen   # before anything else sets the count
    assert set(choice.seconds) == {1, 2} and all(s > 0 for s in choice.seconds.values())
    assert choice.chosen == min(choice.seconds, key=choice.seconds.get)
    assert runtime._time_small_ops(1, runtime._small_op_step(torch.Generator()), 10**6, budget=0.05) > 0, \
        "the budget ends a measurement however many repeats are asked for"
    assert torch.equal(torch.random.get_rng_state(), before)
    assert f"set_threads({1 if choice.chosen == 2 else 2})" in choice.message()


def test_set_threads_changes_the_count_mid_notebook_and_names_a_bad_argument(restore_threads):
    assert runtime.set_threads(1) == 1 and torch.get_num_threads() == 1
    with pytest.raises(ValueError, match="count: expected a whole number of CPU threads >= 1, got 0"):
        runtime.set_threads(0)
    for bad in ("2", 1.5, True):
        with pytest.raises(TypeError, match="count: expected a whole number of CPU threads"):
            runtime.set_threads(bad)
    with pytest.raises(ValueError, match="candidates"):
        runtime.choose_threads(candidates=[0, 1])
