"""`bench triton`: notebook 10's compiled Triton kernel against SDPA on a GPU (issue 49).

Without CUDA the command says in one line that it skipped (after refusing bad sizes); the rows themselves are computed here in
Triton's interpreter at tiny sizes, so the code that times and compares runs on every machine."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from course_lib.runs import bench
from course_lib.runs.bench import triton_benchmark
from course_lib.runs.run_folder import RunRefused


def test_on_the_cpu_the_command_says_it_skipped_in_one_line(capsys):
    assert bench.main(["triton", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("bench triton: skipped on cpu"), out


_ROWS = """
import json, torch
from course_lib.runs.bench import print_triton_rows, triton_benchmark
rows = triton_benchmark([20], [16], heads=1, repeats=1, device="cuda" if torch.cuda.is_available() else "cpu")
print_triton_rows(rows, [], "test")
print(json.dumps(rows))
"""


def test_rows_time_both_precisions_and_measure_their_difference_from_float64():
    # a fresh process: in this one another test may have imported Triton before TRITON_INTERPRET was set
    done = subprocess.run([sys.executable, "-c", _ROWS], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "" if torch.cuda.is_available() else "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(r["head_dim"], r["causal"], r["length"]) for r in rows] == [(16, False, 20), (16, True, 20)]
    for row in rows:
        assert row["ieee_diff"] < 1e-5                       # full float32: the notebook's tolerance
        assert all(math.isfinite(row[key]) and row[key] > 0 for key in ("ieee_ms", "tf32_ms", "sdpa_fp32_ms"))
    assert "ieee diff" in done.stdout


@pytest.mark.parametrize("kwargs, message", [
    (dict(lengths=[0]), "lengths: expected"), (dict(head_dims=[24]), "head_dims: expected powers of two"),
    (dict(head_dims=[8]), "head_dims: expected powers of two"), (dict(heads=0), "heads: expected"),
    (dict(repeats=-1), "repeats: expected")])
def test_bad_sizes_are_refused_naming_the_argument(kwargs, message):
    args = dict(lengths=[16], head_dims=[16], heads=1, repeats=1, device="cpu") | kwargs
    lengths, head_dims = args.pop("lengths"), args.pop("head_dims")
    with pytest.raises(ValueError, match=message):
        triton_benchmark(lengths, head_dims, **args)


@pytest.mark.parametrize("argv", [["--head-dims", "24"], ["--lengths", "0"], ["--repeats", "0"]])
def test_the_command_refuses_bad_sizes_in_one_line_before_looking_for_a_gpu(argv, capsys):
    with pytest.raises(RunRefused, match=argv[0][2:].replace("-", "_")):
        bench.main(["triton", "--device", "cpu", *argv])
    assert "skipped" not in capsys.readouterr().out


_TILES = """
import json, torch
from course_lib.runs.bench import print_triton_tiles, triton_tile_probe
rows = triton_tile_probe(20, [16], tiles=[(16, 16), (32, 16)], warps=[4, 8], heads=1, repeats=1,
                         device="cuda" if torch.cuda.is_available() else "cpu")
print_triton_tiles(rows, 20, "test")
print(json.dumps(rows))
"""


def test_the_tile_probe_times_every_shape_and_warp_count():
    done = subprocess.run([sys.executable, "-c", _TILES], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "" if torch.cuda.is_available() else "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(r["causal"], tuple(r["tile"]), r["warps"]) for r in rows] == [
        (c, t, w) for c in (False, True) for t in ((16, 16), (32, 16)) for w in (4, 8)]
    assert all(r["ms"] > 0 for r in rows)
    # registers exist only where the kernel is compiled
    assert all((r["registers"] is None) == (not torch.cuda.is_available()) for r in rows)
    assert "spilled" in done.stdout


@pytest.mark.parametrize("kwargs, message", [
    (dict(tiles=[(64, 24)]), r"tiles: expected \(queries, keys\) pairs of powers of two .*got \(64, 24\)"),
    (dict(tiles=[64]), r"tiles: expected .*got 64"), (dict(warps=[3]), "warps: expected powers of two"),
    (dict(warps=[64]), "warps: expected powers of two"), (dict(head_dims=[24]), "head_dims: expected")])
def test_the_tile_probe_refuses_bad_settings_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bench.triton_tile_probe(**(dict(length=16, head_dims=[16], heads=1, repeats=1, device="cpu") | kwargs))


def test_compiled_registers_needs_a_gpu():
    from course_lib import flash_triton
    with pytest.raises(ValueError, match="device: expected a CUDA device with the compiled kernel .*got cpu"):
        flash_triton.compiled_registers(64, block_q=64, block_k=64, device="cpu")
