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
