"""Two gloo processes under torchrun follow the same loss trajectory as one process with the combined batch."""
import json
import os
import subprocess
import sys

import pytest

from course_lib import distributed
from course_lib.checkpoints import load_checkpoint

TEXT = "to be or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 60


def run(args, tmp_path, name):
    result = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return json.loads((tmp_path / name / "metrics.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("ddp")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    common = ["--preset", "tiny", "--steps", "20", "--corpus", str(corpus), "--device", "cpu", "--quiet"]
    single = run([sys.executable, "-m", "course_lib", "train", *common, "--batch-size", "16", "--out", "single"],
                 tmp_path, "single")
    ddp = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "course_lib", "train", *common, "--batch-size", "8", "--out", "ddp"], tmp_path, "ddp")
    return tmp_path, single, ddp


@pytest.mark.slow
def test_two_processes_match_one_process_with_the_combined_batch(runs):
    _, single, ddp = runs
    assert ddp["world_size"] == 2 and single["world_size"] == 1
    assert ddp["history"]["step"] == single["history"]["step"]
    for a, b in zip(ddp["history"]["train_loss"], single["history"]["train_loss"]):
        assert abs(a - b) < 1e-3, (ddp["history"]["train_loss"], single["history"]["train_loss"])
    assert abs(ddp["val_loss"] - single["val_loss"]) < 1e-3
    # the loss really moved, so matching trajectories mean something
    assert single["history"]["train_loss"][-1] < single["history"]["train_loss"][0] - 0.3


@pytest.mark.slow
def test_each_process_gets_its_share_of_threads(runs):
    _, _, ddp = runs
    wanted = os.environ.get("COURSE_THREADS")
    # torchrun alone would leave every process at OMP_NUM_THREADS=1
    expected = max(1, int(wanted)) if wanted else max(1, (os.cpu_count() or 1) // 2)
    assert ddp["threads"] == expected


def test_the_cores_are_split_between_the_processes_of_one_machine(monkeypatch):
    monkeypatch.delenv("COURSE_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert [distributed._threads_per_process(n) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    monkeypatch.setenv("COURSE_THREADS", "3")
    assert distributed._threads_per_process(2) == 3


@pytest.mark.slow
def test_rank_zero_writes_a_loadable_checkpoint(runs):
    tmp_path, _, ddp = runs
    loaded = load_checkpoint(tmp_path / "ddp" / "checkpoint.pt")
    assert loaded.model.num_parameters() == ddp["parameters"]
    assert loaded.extra["steps"] == 20


def test_teardown_names_a_wrong_argument():
    from course_lib.distributed import teardown_distributed
    with pytest.raises(TypeError, match="wait_for_all: expected True or False, got str"):
        teardown_distributed(wait_for_all="yes")


@pytest.mark.slow
def test_sigterm_under_torchrun_stops_every_rank_at_one_step_and_rank_zero_saves(tmp_path):
    import signal
    import time
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "course_lib",
         "train", "--preset", "tiny", "--steps", "100000", "--corpus", str(corpus), "--device", "cpu", "--quiet",
         "--out", str(out)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(2400):   # the first checkpoint (step 50): both ranks are training
        if (out / "checkpoint.pt").exists() or process.poll() is not None:
            break
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)   # torchrun passes it on to every worker
    _, stderr = process.communicate(timeout=240)
    metrics = json.loads((out / "metrics.json").read_text())
    saved = load_checkpoint(out / "checkpoint.pt")
    # torchrun itself reports the signal its own way; the workers stopped cleanly, together
    assert metrics["status"] == "stopped" and metrics["world_size"] == 2, stderr[-3000:]
    assert saved.training["step"] == metrics["step"] and f"stopped at step {metrics['step']} " in stderr
    assert sorted(p.name for p in out.iterdir()) == [".course_lib-run.lock", "checkpoint.pt", "metrics.json"]
