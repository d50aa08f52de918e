"""nanoGPT's own recipe and ours on the same device, one after the other: ``bench nanogpt --nanogpt DIR``.

nanoGPT is not part of the course: point ``--nanogpt`` at a checkout of it (``git clone
https://github.com/karpathy/nanoGPT``). Its files are copied into a scratch folder first, so the
checkout is never written to; its data is made by its own ``prepare.py`` from the course's copy of
tinyshakespeare (given as ``input.txt``, so nothing is downloaded), and it trains with its own
``train.py`` and ``config/train_shakespeare_char.py``. Ours runs as ``python -m course_lib train``
(several presets one after the other, after one nanoGPT run), so both wall times count the same things:
starting Python, reading the data, compiling (each run from empty caches of its own), training and
evaluating.

Both split the text the same way (the first 90% to train on, the rest to validate). nanoGPT's
loss is its best estimate (``eval_iters`` random batches); ours is the final evaluation over every
validation window, with the weights the run kept (with ``patience``, those of its best estimate).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import _validate as validate
from ..data import CORPORA, load_corpus, load_text
from .presets import PRESETS

__all__ = ["NANOGPT_CONFIG", "A100_BF16_PEAK", "parse_nanogpt_log", "check_nanogpt", "side_by_side",
           "print_side_by_side"]

NANOGPT_CONFIG = "config/train_shakespeare_char.py"
NANOGPT_FILES = ("train.py", "model.py", "configurator.py", NANOGPT_CONFIG, "data/shakespeare_char/prepare.py")
# nanoGPT reports its MFU against an A100's bf16 peak (model.py, estimate_mfu): 312 TFLOP/s
A100_BF16_PEAK = 312e12

_EVAL = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)", re.M)
_ITER = re.compile(r"^iter (\d+): loss ([\d.]+), time ([\d.]+)ms, mfu (-?[\d.]+)%", re.M)
_TOKENS = re.compile(r"^tokens per iteration will be: ([\d,]+)", re.M)


def parse_nanogpt_log(log: str) -> dict[str, Any]:
    """What nanoGPT's ``train.py`` printed: its validation estimates, step times and MFU.

    ``tokens_per_second`` comes from the median step time, which leaves out the slow first steps
    (compiling) and the steps that also ran an evaluation.
    """
    if not isinstance(log, str):
        raise TypeError(f"log: expected nanoGPT's output as a str, got {validate.describe(log)}")
    estimates = [(int(step), float(val)) for step, _, val in _EVAL.findall(log)]
    iters = [(int(step), float(ms), float(mfu)) for step, _, ms, mfu in _ITER.findall(log)]
    tokens = _TOKENS.search(log)
    if not estimates or not iters or tokens is None:
        raise ValueError("log: expected nanoGPT train.py's output (its 'tokens per iteration', 'step N: ... val "
                         f"loss' and 'iter N: ... mfu' lines), got {len(estimates)} estimates and {len(iters)} "
                         f"step lines; its last lines were:\n" + "\n".join(log.strip().splitlines()[-5:]))
    best_step, best_val = min(estimates, key=lambda e: e[1])
    tokens_per_iter = int(tokens.group(1).replace(",", ""))
    median_ms = statistics.median(ms for _, ms, _ in iters)
    return {"best_val_loss": best_val, "best_step": best_step, "steps": iters[-1][0],
            "estimates": estimates, "tokens_per_iter": tokens_per_iter,
            "tokens_per_second": tokens_per_iter / (median_ms / 1000), "mfu_a100": iters[-1][2] / 100}


def check_nanogpt(folder: Any) -> Path:
    """``folder`` as a Path, if it holds the nanoGPT files the comparison runs; else a ValueError."""
    if not isinstance(folder, (str, Path)):
        raise TypeError(f"nanogpt: expected the path of a nanoGPT checkout, got {validate.describe(folder)}")
    folder = Path(folder).expanduser()
    missing = [name for name in NANOGPT_FILES if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"nanogpt: expected a nanoGPT checkout (git clone https://github.com/karpathy/nanoGPT), "
                         f"got {str(folder)!r}, which lacks {', '.join(missing)}")
    return folder


def _run(command: list[str], cwd: Path, what: str, env: dict[str, str] | None = None,
         caches: Path | None = None) -> tuple[str, float]:
    """Run ``command``; return its output and its wall time. A failure raises, with the output's end.

    ``caches``: an empty folder for torch.compile's and Triton's caches, so that every run compiles from
    nothing, as a first run on a new machine does, whichever ran before it.
    """
    if caches is not None:
        env = {**(env or os.environ), "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
               "TRITON_CACHE_DIR": str(caches / "triton")}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    output = done.stdout + done.stderr
    if done.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise RuntimeError(f"{what} failed (exit status {done.returncode}): {' '.join(command)}\n{tail}")
    return output, seconds


def _can_import(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _nanogpt_env(scratch: Path) -> dict[str, str] | None:
    # prepare.py imports requests for its download, which input.txt makes unnecessary: where requests
    # is missing, a stand-in that refuses to download lets the script run as written.
    if _can_import("requests"):
        return None
    stub = scratch / "no-download"
    stub.mkdir()
    (stub / "requests.py").write_text(
        "def get(url, *args, **kwargs):\n    raise RuntimeError('no download here: input.txt is given')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(stub), os.environ.get("PYTHONPATH")]))}


def side_by_side(nanogpt: str | Path, *, preset: str | Sequence[str] = "shakespeare_char_gpu", device: str = "cuda",
                 corpus: str = "tinyshakespeare", nanogpt_args: Sequence[str] = (),
                 course_args: Sequence[str] = (), peak_flops: float | None = None) -> dict[str, Any]:
    """Train nanoGPT's Shakespeare recipe, then ``preset`` (a name, or several run one after the other),
    on ``device``; return the results.

    ``nanogpt_args`` and ``course_args`` go to each command line as they are (``--max_iters=20`` for
    nanoGPT, ``--steps 20`` for ours: for smoke runs). ``peak_flops``: the device's peak FLOP/s for
    the share of peak (the caller measures it; None leaves the shares out). ``result["courses"]`` has
    one row per preset (a preset whose run failed has only its name and ``error``; the others still run);
    ``result["course"]`` and ``result["wall_ratio"]`` are the first's.
    """
    folder = check_nanogpt(nanogpt)
    presets = [preset] if isinstance(preset, str) else list(preset) if isinstance(preset, (list, tuple)) else None
    if not presets:
        raise TypeError(f"preset: expected a preset name or a non-empty list of them, got {validate.describe(preset)}")
    for name in presets:
        validate.one_of("preset", name, sorted(PRESETS))
    if not isinstance(device, str) or not device:
        raise TypeError(f"device: expected a device name such as 'cuda' or 'cpu', got {validate.describe(device)}")
    for name, args in (("nanogpt_args", nanogpt_args), ("course_args", course_args)):
        if isinstance(args, str) or not all(isinstance(a, str) for a in args):
            raise TypeError(f"{name}: expected a list of command-line words, got {validate.describe(args)}")
    if peak_flops is not None:
        validate.positive_float("peak_flops", peak_flops, finite=True)
    text = load_corpus(corpus) if corpus in CORPORA else load_text(Path(corpus))
    with tempfile.TemporaryDirectory(prefix="course-side-by-side-") as scratch_name:
        scratch = Path(scratch_name)
        copy = scratch / "nanoGPT"
        shutil.copytree(folder, copy, ignore=shutil.ignore_patterns(".git", "out*", "*.bin", "*.pkl", "*.pt"))
        data = copy / "data" / "shakespeare_char"
        (data / "input.txt").write_text(text, encoding="utf-8")
        env = _nanogpt_env(scratch)
        _run([sys.executable, "prepare.py"], data, "nanoGPT's prepare.py", env)
        log, nano_seconds = _run([sys.executable, "train.py", NANOGPT_CONFIG, f"--device={device}",
                                  f"--out_dir={scratch / 'nanogpt-out'}", *nanogpt_args], copy, "nanoGPT's train.py",
                                 env, caches=scratch / "nanogpt-caches")
        nano = {**parse_nanogpt_log(log), "wall_seconds": nano_seconds}

        if corpus not in CORPORA:
            course_args = ["--corpus", str(Path(corpus).resolve()), *course_args]
        courses = []
        for i, name in enumerate(presets):
            try:
                courses.append(_course_run(name, scratch / f"course-run-{i}", device, course_args, peak_flops,
                                           nano_seconds))
            except RuntimeError as failed:   # nanoGPT's figures and the other presets' still count
                courses.append({"preset": name, "error": str(failed)})
    if peak_flops is not None:
        nano["share_of_peak"] = nano["mfu_a100"] * A100_BF16_PEAK / peak_flops
    return {"device": device, "preset": presets[0], "peak_flops": peak_flops, "nanogpt": nano,
            "course": courses[0], "courses": courses, "wall_ratio": courses[0].get("wall_ratio")}


def _course_run(preset: str, run: Path, device: str, course_args: Sequence[str], peak_flops: float | None,
                nano_seconds: float) -> dict[str, Any]:
    """``python -m course_lib train --preset preset`` in a fresh process, read back from its metrics.json."""
    _, seconds = _run([sys.executable, "-m", "course_lib", "train", "--preset", preset, "--out", str(run),
                       "--device", device, "--quiet", *course_args], Path.cwd(), f"course_lib {preset}",
                      caches=run.with_name(run.name + "-caches"))
    metrics = json.loads((run / "metrics.json").read_text(encoding="utf-8"))
    history = metrics["history"]
    course = {"preset": preset, "val_loss": metrics["val_loss"], "best_step": history["best_step"],
              "best_val_loss": history["best_val_loss"], "steps": metrics["steps"],
              "stop_reason": history["stop_reason"], "tokens_per_second": metrics["tokens_per_second"],
              "achieved_flops": metrics["achieved_flops"], "train_seconds": metrics["train_seconds"],
              "val_steps": history["val_step"], "val_estimates": history["val_loss"],
              "wall_seconds": seconds, "wall_ratio": seconds / nano_seconds}
    # nanoGPT's rate leaves out its first steps (compiling); ours does the same, where the run timed its first step
    first = history.get("first_step_seconds", 0.0)
    if 0 < first < metrics["train_seconds"] and metrics["steps"] > 1:
        tokens_per_step = history["tokens_seen"] / metrics["steps"]
        steady = (history["tokens_seen"] - tokens_per_step) / (metrics["train_seconds"] - first)
        course["achieved_flops"] *= steady / course["tokens_per_second"]
        course["tokens_per_second"], course["first_step_seconds"] = steady, first
    if peak_flops is not None:
        course["share_of_peak"] = course["achieved_flops"] / peak_flops
    return course


def print_side_by_side(result: dict[str, Any], device_name: str) -> None:
    nano = result["nanogpt"]
    share = (lambda r: f"{100 * r['share_of_peak']:.1f}%") if result["peak_flops"] else (lambda r: "n/a")
    peak = result["peak_flops"]
    print(f"on {device_name}" + (f" (measured matmul peak {peak / 1e9:,.0f} GFLOP/s)" if peak else ""))
    header = f"{'recipe':<34}{'val loss':>9}{'at step':>9}{'steps':>7}{'wall s':>8}{'tokens/s':>11}{'% peak':>8}"
    print(header)
    print("-" * len(header))
    print(f"{'nanoGPT train_shakespeare_char':<34}{nano['best_val_loss']:>9.4f}{nano['best_step']:>9d}"
          f"{nano['steps']:>7d}{nano['wall_seconds']:>8.1f}{nano['tokens_per_second']:>11.0f}{share(nano):>8}")
    for course in result["courses"]:
        if "error" in course:
            print(f"{'course ' + course['preset']:<34} failed: {course['error']}")
            continue
        best_step = "-" if course["best_step"] is None else str(course["best_step"])   # no estimate was made
        print(f"{'course ' + course['preset']:<34}{course['val_loss']:>9.4f}{best_step:>9}"
              f"{course['steps']:>7d}{course['wall_seconds']:>8.1f}{course['tokens_per_second']:>11.0f}"
              f"{share(course):>8}")
    print("(nanoGPT: its best estimate, eval_iters random batches; ours: every validation window, with the "
          "weights the run kept. Wall time: the whole command, start-up and compiling included; tokens/s: "
          "training steps after the first, which compiles)")
    print("nanoGPT's estimates " + ", ".join(f"{step}:{loss:.3f}" for step, loss in nano["estimates"]))
    for course in (c for c in result["courses"] if "error" not in c):
        print(f"{course['preset']}: wall time / nanoGPT's {course['wall_ratio']:.2f}; first step "
              f"{course.get('first_step_seconds', 0.0):.1f} s; stopped on "
              f"{course['stop_reason']}; estimates " + ", ".join(
                  f"{step}:{loss:.3f}" for step, loss in zip(course["val_steps"], course["val_estimates"])))
