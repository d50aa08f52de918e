"""bench nanogpt: nanoGPT's recipe and ours side by side, with a stand-in for a nanoGPT checkout.

nanoGPT is never part of the project, so these tests write a checkout of the same shape whose
train.py prints what nanoGPT's prints. What they check: the checkout is copied and never written
to, its prepare.py gets the course's text as input.txt, both commands run, and the figures are
read from their output.
"""
import re

import pytest

from course_lib.runs import bench
from course_lib.runs.side_by_side import A100_BF16_PEAK, parse_nanogpt_log, side_by_side

TEXT = "".join(f"{w} said the {a} to the {b}.\n" for w, a, b in zip(["ann", "bob", "cy", "di"] * 60,
                                                                     ["cat", "dog", "owl"] * 80,
                                                                     ["moon", "sea", "king", "queen", "fox"] * 48))

# What nanoGPT's train.py prints (its format, its numbers made up), for a run of 20 iterations.
NANOGPT_LOG = """\
tokens per iteration will be: 16,384
found vocab_size = 65 (inside data/shakespeare_char/meta.pkl)
step 0: train loss 4.2874, val loss 4.2823
iter 0: loss 4.2654, time 20000.00ms, mfu -100.00%
iter 5: loss 3.1000, time 100.00ms, mfu 10.00%
step 10: train loss 2.5000, val loss 2.5500
iter 10: loss 2.4000, time 900.00ms, mfu 9.00%
iter 15: loss 2.2000, time 100.00ms, mfu 12.00%
step 20: train loss 2.1000, val loss 2.6000
iter 20: loss 2.0000, time 100.00ms, mfu 12.50%
"""

FAKE_TRAIN = f"""\
import pathlib, sys
# as nanoGPT's: the config file first, then --key=value overrides
assert sys.argv[1] == "config/train_shakespeare_char.py", sys.argv
assert pathlib.Path("data/shakespeare_char/train.bin").read_text() == "prepared", "prepare.py did not run"
print({NANOGPT_LOG!r}, end="")
print("overrides:", " ".join(sys.argv[2:]))
"""

FAKE_PREPARE = """\
import pathlib
import requests   # as nanoGPT's: imported for a download that input.txt makes unnecessary
here = pathlib.Path(__file__).parent
text = (here / "input.txt").read_text()
assert "said the cat" in text, text[:100]
(here / "train.bin").write_text("prepared")
"""


@pytest.fixture
def checkout(tmp_path):
    folder = tmp_path / "nanoGPT"
    for name, body in {"train.py": FAKE_TRAIN, "model.py": "", "configurator.py": "",
                       "config/train_shakespeare_char.py": "", "data/shakespeare_char/prepare.py": FAKE_PREPARE}.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(body)
    return folder


def _files(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_log_reader_finds_the_best_estimate_and_the_typical_step():
    read = parse_nanogpt_log(NANOGPT_LOG)
    assert (read["best_val_loss"], read["best_step"], read["steps"]) == (2.55, 10, 20)
    assert read["estimates"] == [(0, 4.2823), (10, 2.55), (20, 2.6)]
    # the median step (100 ms) leaves out the compiling first step and the one that also evaluated
    assert read["tokens_per_second"] == pytest.approx(16384 / 0.1)
    assert read["mfu_a100"] == pytest.approx(0.125)   # the last report, not the -100% placeholder
    with pytest.raises(ValueError, match=r"^log: expected nanoGPT train.py's output .*got 0 estimates"):
        parse_nanogpt_log("Traceback (most recent call last):\nModuleNotFoundError: No module named 'tiktoken'\n")


def test_side_by_side_runs_both_and_leaves_the_checkout_alone(checkout, tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    before = _files(checkout)
    # as on a machine without requests: prepare.py imports a stand-in that cannot download
    monkeypatch.setattr("course_lib.runs.side_by_side._can_import", lambda name: False)
    result = side_by_side(checkout, preset="tiny", device="cpu", corpus=str(corpus),
                          nanogpt_args=["--max_iters=20"], course_args=["--steps", "4"], peak_flops=1e12)
    assert _files(checkout) == before   # copied, never written to
    nano, course = result["nanogpt"], result["course"]
    assert (nano["best_val_loss"], nano["best_step"]) == (2.55, 10) and nano["wall_seconds"] > 0
    assert nano["share_of_peak"] == pytest.approx(0.125 * A100_BF16_PEAK / 1e12)
    assert course["steps"] == 4 and course["stop_reason"] == "steps" and 0 < course["val_loss"] < 10
    assert course["share_of_peak"] == pytest.approx(course["achieved_flops"] / 1e12)
    assert result["wall_ratio"] == pytest.approx(course["wall_seconds"] / nano["wall_seconds"])


def test_bench_nanogpt_prints_both_rows(checkout, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    assert bench.main(["nanogpt", "--nanogpt", str(checkout), "--preset", "tiny", "--peak-sizes", "64",
                       "--corpus", str(corpus), "--course-args", "--steps 3"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^nanoGPT train_shakespeare_char +2\.5500 +10 +20 ", out, re.M), out
    assert re.search(r"^course tiny +\d\.\d{4} +- +3 ", out, re.M), out   # 3 steps: no estimate yet
    assert re.search(r"^tiny: wall time / nanoGPT.s \d+\.\d\d; first step \d+\.\d s; stopped on steps", out, re.M), out


def test_bench_nanogpt_refuses_what_is_not_a_checkout(tmp_path, checkout):
    from course_lib.runs.run_folder import RunRefused
    with pytest.raises(RunRefused, match=r"nanogpt: expected a nanoGPT checkout .*lacks train.py"):
        bench.main(["nanogpt", "--nanogpt", str(tmp_path / "empty")])
    with pytest.raises(RunRefused, match=r"preset: expected one of .*got 'huge'"):
        bench.main(["nanogpt", "--nanogpt", str(checkout), "--preset", "huge", "--peak-sizes", "64"])
    with pytest.raises(TypeError, match=r"nanogpt_args: expected a list of command-line words"):
        side_by_side(checkout, device="cpu", nanogpt_args="--max_iters=20")


def test_a_failing_nanogpt_run_is_reported_with_its_last_lines(checkout, tmp_path):
    (checkout / "train.py").write_text("import sys\nprint('CUDA error: no kernel image')\nsys.exit(3)\n")
    with pytest.raises(RuntimeError, match=r"nanoGPT's train.py failed \(exit status 3\).*\n.*no kernel image"):
        side_by_side(checkout, preset="tiny", device="cpu", corpus=str(_corpus(tmp_path)))


def _corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path



def test_without_requests_prepare_gets_a_stand_in_that_cannot_download(tmp_path, monkeypatch):
    import subprocess
    import sys

    from course_lib.runs import side_by_side as module
    monkeypatch.setattr(module, "_can_import", lambda name: False)
    env = module._nanogpt_env(tmp_path)
    done = subprocess.run([sys.executable, "-c", "import requests; requests.get('https://example.org')"],
                          env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "no download here: input.txt is given" in done.stderr
    monkeypatch.setattr(module, "_can_import", lambda name: True)
    assert module._nanogpt_env(tmp_path) is None   # the real one is there: nothing is changed


def test_several_presets_run_after_one_nanogpt_run_each_from_empty_compile_caches(checkout, tmp_path, monkeypatch):
    from course_lib.runs import side_by_side as module
    seen = []
    real_run = module._run

    def recording_run(command, cwd, what, env=None, caches=None):
        seen.append((what, caches))
        return real_run(command, cwd, what, env, caches)

    monkeypatch.setattr(module, "_run", recording_run)
    result = side_by_side(checkout, preset=["tiny", "tiny"], device="cpu", corpus=str(_corpus(tmp_path)),
                          course_args=["--steps", "3"])
    assert [what for what, _ in seen] == ["nanoGPT's prepare.py", "nanoGPT's train.py", "course_lib tiny",
                                          "course_lib tiny"]
    caches = [c for what, c in seen if what != "nanoGPT's prepare.py"]
    assert None not in caches and len(set(caches)) == 3   # each training run compiles from nothing
    assert [c["preset"] for c in result["courses"]] == ["tiny", "tiny"] and result["course"] is result["courses"][0]
    assert all(c["steps"] == 3 and c["wall_ratio"] > 0 for c in result["courses"])
    # the rate leaves out the first step, as nanoGPT's median does: the tokens of the other two steps over their time
    # (whether that is above the whole run's rate depends on the machine's timing, so it is not asserted)
    for c in result["courses"]:
        assert 0 < c["first_step_seconds"] < c["train_seconds"]
        assert c["tokens_per_second"] == pytest.approx(2 * 16 * 32 / (c["train_seconds"] - c["first_step_seconds"]))


def test_the_fresh_caches_reach_the_command(tmp_path):
    import sys

    from course_lib.runs.side_by_side import _run
    out, _ = _run([sys.executable, "-c", "import os; print(os.environ['TORCHINDUCTOR_CACHE_DIR'], "
                   "os.environ['TRITON_CACHE_DIR'])"], tmp_path, "a probe", caches=tmp_path / "c")
    assert out.split() == [str(tmp_path / "c" / "inductor"), str(tmp_path / "c" / "triton")]


def test_a_failing_preset_is_a_row_of_its_own_and_the_exit_status_says_so(checkout, tmp_path, monkeypatch, capsys):
    from course_lib.runs import side_by_side as module
    real = module._course_run

    def failing_second(preset, run, *args):
        if run.name.endswith("-1"):
            raise RuntimeError("course_lib tiny failed (exit status 1): CUDA error: out of memory")
        return real(preset, run, *args)

    monkeypatch.setattr(module, "_course_run", failing_second)
    status = bench.main(["nanogpt", "--nanogpt", str(checkout), "--preset", "tiny", "tiny", "--peak-sizes", "64",
                         "--corpus", str(_corpus(tmp_path)), "--course-args", "--steps 3"])
    out = capsys.readouterr().out
    assert status == 1
    assert re.search(r"^course tiny +\d\.\d{4} +- +3 ", out, re.M), out        # the first still counts
    assert re.search(r"^course tiny +failed: .*out of memory", out, re.M), out
    assert "nanoGPT's estimates 0:4.282, 10:2.550, 20:2.600" in out


def test_preset_must_name_presets(checkout):
    with pytest.raises(TypeError, match=r"preset: expected a preset name or a non-empty list of them, got"):
        side_by_side(checkout, preset=[], device="cpu")
    with pytest.raises(ValueError, match=r"preset: expected one of .*got 'huge'"):
        side_by_side(checkout, preset=["tiny", "huge"], device="cpu")
