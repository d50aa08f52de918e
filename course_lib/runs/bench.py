"""Benchmarks: ``python -m course_lib bench training | attention | generate``.

Each benchmark is also a function (``training_benchmark``, ``attention_benchmark``,
``generation_benchmark``) that takes small sizes, so tests and notebook 06 can run it
in a second. Timings are printed, never asserted: they depend on the machine and on
whatever else it is doing, so compare numbers measured back to back.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .. import _validate as validate
from .._rng import leaves_rng_alone
from .presets import PRESETS, run_preset

__all__ = [
    "measure_matmul_peak", "peak_memory_mb", "time_call", "time_alternating", "training_benchmark",
    "attention_benchmark", "generation_benchmark", "GENERATION_CONFIG", "DEFAULT_LENGTHS",
    "ATTENTION_WIDTHS", "triton_benchmark", "triton_memory_benchmark", "check_triton_sizes", "print_triton_rows", "main",
]

DEFAULT_PRESETS = ("baseline_cpu", "shakespeare_char_cpu", "shakespeare_char_modern_cpu")
DEFAULT_LENGTHS = (64, 128, 256, 512, 1024)
CPU_RECIPE, GPU_RECIPE = PRESETS["shakespeare_char_cpu"].model, PRESETS["shakespeare_char_gpu"].model
# (embed_dim, num_heads) of the two training recipes, read from the presets so they cannot drift apart.
ATTENTION_WIDTHS = tuple((recipe["embed_dim"], recipe["num_heads"]) for recipe in (CPU_RECIPE, GPU_RECIPE))
# The size of the GPU recipe with tinyshakespeare's 65-character vocabulary.
GENERATION_CONFIG = dict(vocab_size=65, **{key: GPU_RECIPE[key]
                                           for key in ("max_tokens", "embed_dim", "num_heads", "num_layers")})


# ---------------------------------------------------------------- measuring

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@leaves_rng_alone   # a benchmark seeds its own inputs
def measure_matmul_peak(sizes: Sequence[int] = (1024, 2048), repeats: int = 3,
                        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """The best square-matmul speed seen here, in GFLOP/s: the yardstick for "% of peak".

    A matmul of two (n, n) matrices does 2n^3 floating-point operations. Best-of-``repeats``
    because a busy machine can only make a run slower, never faster. ``dtype``: fp32 for CPU
    training, bf16 for a GPU that trains under bf16 autocast.
    """
    validate.int_list("sizes", sizes)
    validate.positive_int("repeats", repeats)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: expected torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}")
    device = torch.device(device)
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        a @ b                                  # warm-up: thread pool, caches, kernel choice
        _sync(device)
        for _ in range(repeats):
            started = time.perf_counter()
            a @ b
            _sync(device)
            best = max(best, 2 * n ** 3 / (time.perf_counter() - started) / 1e9)
    return best


def peak_memory_mb() -> float:
    """This process's peak resident memory so far (max RSS), in MB. It only ever grows."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes
    return peak / 1e6 if sys.platform == "darwin" else peak / 1e3


def time_call(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1,
              device: torch.device | str = "cpu") -> float:
    """Median seconds per call of ``fn()`` after ``warmup`` untimed calls."""
    validate.positive_int("repeats", repeats)
    validate.non_negative_int("warmup", warmup)
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def time_alternating(fns: Sequence[Callable[[], Any]], repeats: int = 5, warmup: int = 1,
                     device: torch.device | str = "cpu") -> list[float]:
    """Median seconds per call of each function, calling them in turn (a, b, a, b, ...)."""
    validate.positive_int("repeats", repeats)
    validate.non_negative_int("warmup", warmup)
    device = torch.device(device)
    for fn in fns:
        for _ in range(warmup):
            fn()
    _sync(device)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times):
            started = time.perf_counter()
            fn()
            _sync(device)
            spent.append(time.perf_counter() - started)
    return [statistics.median(spent) for spent in times]


# ---------------------------------------------------------------- training

@leaves_rng_alone   # a benchmark seeds its own inputs
def training_benchmark(seconds: float | None = None, presets: Sequence[str] = DEFAULT_PRESETS, *,
                       corpus: str | None = None, steps: int | None = None,
                       out_dir: str | Path | None = None, device: torch.device | str = "cpu",
                       peak_gflops: float | None = None, peak_sizes: Sequence[int] = (1024, 2048),
                       seed: int | None = None, verbose: bool = False) -> dict[str, dict[str, Any]]:
    """Train each preset in turn for the same budget; return {preset: metrics}.

    With ``seconds=None`` the first preset (the baseline) runs its own steps, untimed, and every
    later preset gets exactly the training time the baseline took: the comparison is at the
    baseline's own wall time on this machine, whatever the machine. With ``seconds``, every preset
    gets that budget. Training time excludes evaluations and checkpoints, for every preset alike.
    ``seed`` replaces every preset's own seed (initial weights, batches, dropout).

    The metrics are :func:`course_lib.runs.run_preset`'s plus ``peak_gflops`` (the matmul
    peak, measured before and after the runs unless given), ``share_of_peak`` (achieved
    FLOP/s / peak) and ``peak_rss_mb`` (this process's peak memory once that preset has run).
    """
    if seconds is not None:   # inf is no budget: the baseline would never stop
        validate.positive_float("seconds", seconds, finite=True)
    if steps is not None:
        validate.steps("steps", steps)
    if isinstance(presets, str) or not presets:
        raise ValueError(f"presets: expected a non-empty list of preset names, got {validate.describe(presets)}")
    for name in presets:
        validate.one_of("presets", name, sorted(PRESETS))
    device = torch.device(device)
    if out_dir is not None:
        # refused before the peak measurement and the first preset, not after them
        from .run_folder import RunFolder
        for name in presets:
            folder = RunFolder(Path(out_dir) / name, overwrite=True)
            folder.prepare()
            folder.release()   # run_preset takes it again for the run itself
    measure_peak = peak_gflops is None
    if measure_peak:
        peak_gflops = measure_matmul_peak(peak_sizes, device=device)
    validate.positive_float("peak_gflops", peak_gflops)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="course-bench-") as scratch:
        root = Path(out_dir) if out_dir is not None else Path(scratch)
        budget = seconds
        for i, name in enumerate(presets):
            if verbose:
                print(f"training {name} ({f'{budget:.1f} s' if budget else 'its own steps'}) ...", flush=True)
            metrics = run_preset(name, root / name, seconds=budget, steps=steps, corpus=corpus,
                                 device=device, progress=False, seed=seed, overwrite=True)
            if metrics.get("status") == "stopped":   # Ctrl-C or SIGTERM stopped this preset: the bench stops too
                raise BenchStopped(name, metrics.get("signal"))
            if i == 0 and seconds is None:
                budget = metrics["train_seconds"]   # the baseline's own time, for every later preset
            metrics["budget_seconds"] = budget if i or seconds is not None else None
            metrics["peak_rss_mb"] = peak_memory_mb()
            windows = PRESETS[presets[0]].model["max_tokens"]
            if i and PRESETS[name].model["max_tokens"] > windows:
                # A longer context lowers the loss by itself (each prediction sees more), so a preset
                # with longer windows than the first one's is also scored on the first one's windows.
                metrics["val_loss_at_first_windows"] = _score_on_windows(root / name, windows, corpus or PRESETS[name].corpus)
                metrics["first_windows"] = windows
            results[name] = metrics
    if measure_peak:
        # measured again afterwards: a busy moment can only hide the peak, never inflate it
        peak_gflops = max(peak_gflops, measure_matmul_peak(peak_sizes, device=device))
    for metrics in results.values():
        metrics["peak_gflops"] = peak_gflops
        metrics["share_of_peak"] = metrics["achieved_flops"] / (peak_gflops * 1e9)
    return results


class BenchStopped(Exception):
    """A preset's training was stopped (Ctrl-C, SIGTERM): the benchmark ends there, with no figures."""


def _score_on_windows(folder: Path, max_tokens: int, corpus: str) -> float:
    """The validation loss of the run in ``folder`` over windows of ``max_tokens`` tokens."""
    from ..checkpoints import load_checkpoint
    from ..data import corpus_splits
    from ..train import evaluate
    model = load_checkpoint(folder / "checkpoint.pt").model
    _, _, val_split = corpus_splits(corpus, max_tokens)
    return evaluate(model, *val_split.eval_windows(max_tokens))


def _print_training(results: dict[str, dict[str, Any]], peak_gflops: float) -> None:
    print(f"matmul peak (fp32, best of square matmuls): {peak_gflops:.1f} GFLOP/s, "
          f"{torch.get_num_threads()} threads")
    width = max(22, 2 + max(len(name) for name in results))
    header = (f"{'preset':<{width}}{'val_loss':>9}{'steps':>8}{'train_s':>9}{'tokens/s':>10}"
              f"{'GFLOP/s':>9}{'% peak':>8}{'peak MB':>9}")
    print(header)
    print("-" * len(header))
    for name, m in results.items():
        print(f"{name:<{width}}{m['val_loss']:>9.4f}{m['steps']:>8d}{m['train_seconds']:>9.1f}"
              f"{m['tokens_per_second']:>10.0f}{m['achieved_flops'] / 1e9:>9.1f}"
              f"{100 * m['share_of_peak']:>7.1f}%{m['peak_rss_mb']:>9.0f}")
    for name, m in results.items():
        if "val_loss_at_first_windows" in m:
            print(f"{name}: val_loss {m['val_loss_at_first_windows']:.4f} on {m['first_windows']}-token windows, "
                  f"as the first preset's (its own are {m['model']['max_tokens']})")
    print("(val_loss: the whole validation split in non-overlapping windows of each preset's context; FLOP/s from "
          "6N + 12*L*H*Q*T per token; peak MB is this process's peak so far, so it includes "
          "the presets run before)")


COURSE_RECIPES = ("shakespeare_char_cpu", "shakespeare_char_modern_cpu")


def _print_leads(results: dict[str, dict[str, Any]], seconds: float | None) -> None:
    baseline = results.get("baseline_cpu")
    for name in COURSE_RECIPES:
        if baseline is not None and name in results:
            course = results[name]
            when = (f"at the baseline's own time ({baseline['train_seconds']:.1f} s)" if seconds is None
                    else f"at {seconds:g} s each")
            print(f"val_loss {name}={course['val_loss']:.4f} baseline={baseline['val_loss']:.4f} {when}: "
                  f"{baseline['val_loss'] - course['val_loss']:.3f} lower")


def _print_lead_spread(runs: list[dict[str, dict[str, Any]]], seeds: Sequence[int]) -> None:
    """Each preset's loss and each lead over the baseline, as mean and spread over the seeds."""
    def summary(values: list[float]) -> str:
        return (f"mean {statistics.mean(values):.4f}, sd {statistics.stdev(values):.4f}, "
                f"range {min(values):.4f} to {max(values):.4f}")
    print(f"over {len(runs)} seeds ({', '.join(map(str, seeds))}):")
    for name in runs[0]:
        print(f"  val_loss {name}: {summary([r[name]['val_loss'] for r in runs])}")
    if "baseline_cpu" in runs[0]:
        for name in COURSE_RECIPES:
            if name in runs[0]:
                leads = [r["baseline_cpu"]["val_loss"] - r[name]["val_loss"] for r in runs]
                print(f"lead {name} over baseline_cpu: {summary(leads)}")
                if next(iter(runs[0])) == "baseline_cpu" and "val_loss_at_first_windows" in runs[0][name]:
                    leads = [r["baseline_cpu"]["val_loss"] - r[name]["val_loss_at_first_windows"] for r in runs]
                    print(f"lead {name} over baseline_cpu, both on the baseline's "
                          f"{runs[0][name]['first_windows']}-token windows: {summary(leads)}")


# ---------------------------------------------------------------- attention

@leaves_rng_alone   # a benchmark seeds its own inputs
def attention_benchmark(lengths: Sequence[int] = DEFAULT_LENGTHS, embed_dim: int = GPU_RECIPE["embed_dim"],
                        num_heads: int = GPU_RECIPE["num_heads"],
                        batch: int | None = None, repeats: int = 5, *, tokens_per_call: int = 4096,
                        core: bool = True, device: torch.device | str = "cpu",
                        seed: int = 0) -> list[dict[str, Any]]:
    """Time MultiHeadMaskedAttention's plain (einsum) and fused (SDPA) paths per sequence length.

    Both paths share the same weights. ``batch=None`` keeps ``batch * length`` near
    ``tokens_per_call``, so the projections cost the same at every length and what grows is
    attention itself. Returns one row per length: milliseconds for forward and
    forward+backward of each path, the plain/fused ratios, and the largest difference
    between the two paths' outputs. With ``core``, also forward+backward of the attention
    alone (q, k, v given, no projections): ``plain_core_train_ms``, ``fused_core_train_ms``,
    ``core_train_ratio``.
    """
    from ..attention import MultiHeadMaskedAttention
    validate.int_list("lengths", lengths)
    validate.positive_int("embed_dim", embed_dim)
    validate.positive_int("num_heads", num_heads)
    if batch is not None:
        validate.positive_int("batch", batch)
    validate.positive_int("repeats", repeats)
    validate.positive_int("tokens_per_call", tokens_per_call)
    device = torch.device(device)
    torch.manual_seed(seed)
    plain = MultiHeadMaskedAttention(embed_dim, num_heads, max(lengths), fused=False).to(device)
    fused = MultiHeadMaskedAttention(embed_dim, num_heads, max(lengths), fused=True).to(device)
    fused.load_state_dict(plain.state_dict())

    rows = []
    for length in lengths:
        n = batch or max(1, tokens_per_call // length)
        x = torch.randn(n, length, embed_dim, device=device, requires_grad=True)   # (N, L, E)
        with torch.no_grad():
            difference = (plain(x) - fused(x)).abs().max().item()
        row: dict[str, Any] = {"length": length, "batch": n, "max_abs_difference": difference}

        # x and step are bound as defaults: each closure keeps this length's input, not the loop's last.
        def forward(module: torch.nn.Module, x: torch.Tensor = x) -> None:
            with torch.no_grad():
                module(x)

        def forward_backward(module: torch.nn.Module, x: torch.Tensor = x) -> None:
            module(x).sum().backward()
            module.zero_grad(set_to_none=True)
            x.grad = None

        for mode, step in (("forward", forward), ("train", forward_backward)):
            # alternate the two paths call by call, so a busy moment slows both alike
            times = time_alternating([lambda step=step: step(plain), lambda step=step: step(fused)], repeats,
                                     device=device)
            row[f"plain_{mode}_ms"], row[f"fused_{mode}_ms"] = (1e3 * t for t in times)
        row["forward_ratio"] = row["plain_forward_ms"] / row["fused_forward_ms"]
        row["train_ratio"] = row["plain_train_ms"] / row["fused_train_ms"]
        if core:
            times = _time_attention_core(n, num_heads, length, embed_dim // num_heads, repeats, device)
            row["plain_core_train_ms"], row["fused_core_train_ms"] = (1e3 * t for t in times)
            row["core_train_ratio"] = row["plain_core_train_ms"] / row["fused_core_train_ms"]
        rows.append(row)
    return rows


def _time_attention_core(n: int, heads: int, length: int, head_dim: int, repeats: int,
                         device: torch.device) -> list[float]:
    """Forward+backward of softmax(q k^T / sqrt(d) + mask) v alone, the two ways the module computes it."""
    import torch.nn.functional as F

    from ..attention import causal_mask, scaled_dot_product_attention
    q, k, v = (torch.randn(n, heads, length, head_dim, device=device, requires_grad=True)
               for _ in range(3))                                               # (N, heads, L, head_dim)
    mask = causal_mask(length, device=device)                                   # (L, L)

    def plain() -> torch.Tensor:   # step by step: scores, mask, softmax, weighted sum (notebook 01)
        return scaled_dot_product_attention(q, k, v, mask)                     # (N, heads, L, head_dim)

    def fused() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)        # (N, heads, L, head_dim)

    def train(attend: Callable[[], torch.Tensor]) -> None:
        attend().sum().backward()
        q.grad = k.grad = v.grad = None

    return time_alternating([lambda: train(plain), lambda: train(fused)], repeats, device=device)


def _print_attention(rows: list[dict[str, Any]], embed_dim: int, num_heads: int) -> None:
    recipe = {ATTENTION_WIDTHS[0]: " (the CPU recipe's width)",
              ATTENTION_WIDTHS[1]: " (the GPU recipe's width)"}.get((embed_dim, num_heads), "")
    print(f"MultiHeadMaskedAttention(embed_dim={embed_dim}, num_heads={num_heads}){recipe}, "
          f"{torch.get_num_threads()} threads; ms per call (median)")
    core = "core_train_ratio" in rows[0]
    header = (f"{'length':>6}{'batch':>6} | {'plain fwd':>9}{'fused fwd':>10}{'ratio':>7} | "
              f"{'plain f+b':>9}{'fused f+b':>10}{'ratio':>7}" + (f" | {'core f+b ratio':>14}" if core else ""))
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['length']:>6}{r['batch']:>6} | {r['plain_forward_ms']:>9.2f}{r['fused_forward_ms']:>10.2f}"
              f"{r['forward_ratio']:>6.2f}x | {r['plain_train_ms']:>9.2f}{r['fused_train_ms']:>10.2f}"
              f"{r['train_ratio']:>6.2f}x" + (f" | {r['core_train_ratio']:>13.2f}x" if core else ""))
    worst = max(r["max_abs_difference"] for r in rows)
    print(f"(ratio = plain / fused: above 1 means the fused kernel is faster; f+b = forward + backward; "
          f"largest output difference between the paths: {worst:.1e})")
    if core:
        print("(core = the attention alone, softmax(q k^T / sqrt(d) + mask) v, without the projections)")


# ---------------------------------------------------------------- generation

@leaves_rng_alone   # a benchmark seeds its own inputs
def generation_benchmark(config: Any = None, new_tokens: int = 500, *, prompt_tokens: int = 8,
                         seed: int = 0, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Greedy generation with and without the KV cache from a random-weight model.

    ``config`` is a GPTConfig or a dict of its fields (default: the GPU recipe's size,
    ``GENERATION_CONFIG``). Returns seconds and tokens/s for both paths, the speed-up,
    ``identical`` (token-for-token equality of the two outputs) and both outputs.
    """
    from ..generate import generate
    from ..model import GPT, GPTConfig
    if config is None:
        config = GPTConfig(**GENERATION_CONFIG)
    elif isinstance(config, dict):
        config = GPTConfig(**config)
    elif not isinstance(config, GPTConfig):
        raise TypeError(f"config: expected a GPTConfig, a dict of its fields or None, got {validate.describe(config)}")
    validate.positive_int("new_tokens", new_tokens)
    validate.positive_int("prompt_tokens", prompt_tokens)
    device = torch.device(device)
    torch.manual_seed(seed)
    model = GPT(config).to(device).eval()
    prompt = torch.randint(0, config.vocab_size, (1, prompt_tokens),
                           generator=torch.Generator().manual_seed(seed)).to(device)   # (1, prompt_tokens)
    result: dict[str, Any] = {"config": config.to_dict(), "new_tokens": new_tokens,
                              "prompt_tokens": prompt_tokens}
    generate(model, prompt, 4, temperature=0, use_cache=True)   # warm-up
    outputs = {}
    for name, use_cache in (("cached", True), ("uncached", False)):
        _sync(device)
        started = time.perf_counter()
        outputs[name] = generate(model, prompt, new_tokens, temperature=0, use_cache=use_cache)
        _sync(device)
        elapsed = time.perf_counter() - started
        result[f"{name}_seconds"] = elapsed
        result[f"{name}_tokens_per_second"] = new_tokens / elapsed
    result["speedup"] = result["cached_tokens_per_second"] / result["uncached_tokens_per_second"]
    result["identical"] = bool(torch.equal(outputs["cached"], outputs["uncached"]))
    result["cached_ids"] = outputs["cached"].cpu()
    result["uncached_ids"] = outputs["uncached"].cpu()
    return result


def _print_generation(r: dict[str, Any]) -> None:
    c = r["config"]
    print(f"GPT: {c['num_layers']} layers, {c['num_heads']} heads, embed {c['embed_dim']}, "
          f"context {c['max_tokens']}, vocab {c['vocab_size']} (random weights), greedy, "
          f"{r['new_tokens']} new tokens from a {r['prompt_tokens']}-token prompt, "
          f"{torch.get_num_threads()} threads")
    print(f"without cache: {r['uncached_tokens_per_second']:8.1f} tokens/s ({r['uncached_seconds']:.2f} s)")
    print(f"with cache:    {r['cached_tokens_per_second']:8.1f} tokens/s ({r['cached_seconds']:.2f} s)")
    print(f"speed-up: {r['speedup']:.1f}x")
    print(f"identical outputs: {r['identical']}")


# ---------------------------------------------------------------- notebook 10's Triton kernel on a GPU
# ``bench triton``: the compiled kernel (``flash_triton.flash_attention_triton``) in full float32 (``ieee``)
# and in TF32 against ``scaled_dot_product_attention`` in float32 and bfloat16, with the largest difference
# from a float64 reference; then the peak memory of naive, tiled (PyTorch) and Triton attention and SDPA
# against L. Without CUDA the command says so in one line: the interpreter's times say nothing about a GPU.

def _triton_kernel() -> Any:
    from .. import flash_triton  # on import it chooses Triton's interpreter where there is no GPU: only here
    module = flash_triton.load()
    if module is None:
        raise RuntimeError(f"the Triton kernel cannot run here: {flash_triton.UNAVAILABLE}")
    return module


def check_triton_sizes(lengths: Sequence[int], head_dims: Sequence[int], heads: int, repeats: int) -> None:
    """Refuse sizes the kernel cannot take, naming the argument."""
    for length in lengths:
        validate.positive_int("lengths", length)
    for head_dim in head_dims:
        if validate.positive_int("head_dims", head_dim) < 16 or head_dim & (head_dim - 1):
            raise ValueError(f"head_dims: expected powers of two of at least 16 (tl.dot's smallest tile), "
                             f"got {head_dim}")
    validate.positive_int("heads", heads)
    validate.positive_int("repeats", repeats)


def triton_benchmark(lengths: Sequence[int] = (1024, 4096, 16384), head_dims: Sequence[int] = (64, 128), *,
                     heads: int = 16, repeats: int = 10, device: str | torch.device = "cuda") -> list[dict]:
    """One row per (head dim, causal, L): milliseconds per call and the largest difference from float64."""
    import torch.nn.functional as F
    check_triton_sizes(lengths, head_dims, heads, repeats)
    device, kernel, rows = torch.device(device), _triton_kernel(), []
    for head_dim in head_dims:
        for causal in (False, True):
            for length in lengths:
                generator = torch.Generator(device=device).manual_seed(0)
                q, k, v = (torch.randn(1, heads, length, head_dim, device=device, generator=generator)
                           for _ in range(3))                                          # (1, heads, L, d)
                exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
                row = {"head_dim": head_dim, "causal": causal, "length": length}
                for precision in ("ieee", "tf32"):
                    # full float32 tiles of 64 x 32 in 8 warps spill no registers (an H200, d = 64 and 128);
                    # 64 x 64 in 4 warps spilled thousands and ran up to 20 times slower (PERFORMANCE.md)
                    block_k, warps = (32, 8) if precision == "ieee" else (64, 4)
                    run = partial(kernel.flash_attention_triton, q, k, v, block_q=64, block_k=block_k,
                                  causal=causal, precision=precision, num_warps=warps)
                    row[f"{precision}_ms"] = time_call(run, repeats, warmup=2, device=device) * 1e3
                    row[f"{precision}_diff"] = float((run()[0] - exact).abs().max())
                sdpa = F.scaled_dot_product_attention
                row["sdpa_fp32_ms"] = time_call(partial(sdpa, q, k, v, is_causal=causal), repeats, 2, device) * 1e3
                row["sdpa_bf16_ms"] = time_call(partial(sdpa, *(t.bfloat16() for t in (q, k, v)), is_causal=causal),
                                                repeats, 2, device) * 1e3
                rows.append(row)
    return rows


def triton_memory_benchmark(lengths: Sequence[int] = (1024, 4096, 16384), *, heads: int = 4, head_dim: int = 64,
                            tiled_up_to: int = 4096, device: str | torch.device = "cuda") -> list[dict]:
    """Peak memory above the inputs (MiB), causal, per method and L; the PyTorch tiles only up to
    ``tiled_up_to`` (a Python loop over blocks). Needs CUDA's memory counters."""
    import torch.nn.functional as F

    from .. import flash
    device, kernel, rows = torch.device(device), _triton_kernel(), []
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device for its memory counters, got {device}")
    for length in lengths:
        q, k, v = (torch.randn(1, heads, length, head_dim, device=device) for _ in range(3))
        methods = {"naive": partial(flash.naive_attention, q, k, v, causal=True),
                   "tiled": partial(flash.flash_attention, q, k, v, causal=True) if length <= tiled_up_to else None,
                   "triton": partial(kernel.flash_attention_triton, q, k, v, block_q=64, block_k=64, causal=True),
                   "sdpa": partial(F.scaled_dot_product_attention, q, k, v, is_causal=True)}
        row: dict[str, Any] = {"length": length}
        for name, call in methods.items():
            if call is None:
                row[name] = None
                continue
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = call()
            torch.cuda.synchronize()
            row[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
            del out
        rows.append(row)
    return rows


TRITON_TILES = ((64, 64), (64, 32), (64, 16), (32, 32), (128, 64))   # (queries, keys) a program holds


def triton_tile_probe(length: int = 4096, head_dims: Sequence[int] = (64, 128), *,
                      tiles: Sequence[tuple[int, int]] = TRITON_TILES, warps: Sequence[int] = (4, 8), heads: int = 16,
                      repeats: int = 10, device: str | torch.device = "cuda") -> list[dict]:
    """Full float32 (``ieee``) only: ms per call for each tile shape and warp count, with the compiled kernel's
    registers per thread and registers spilled (None where the kernel is interpreted). PERFORMANCE.md's table
    of why full float32 was slow comes from this."""
    check_triton_sizes([length], head_dims, heads, repeats)
    for tile in tiles:
        if (not isinstance(tile, (tuple, list)) or len(tile) != 2 or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 16 and not n & (n - 1) for n in tile)):
            raise ValueError(f"tiles: expected (queries, keys) pairs of powers of two of at least 16 (tl.dot's "
                             f"smallest tile), got {tile!r}")
    for count in warps:
        if validate.positive_int("warps", count) > 32 or count & (count - 1):
            raise ValueError(f"warps: expected powers of two from 1 to 32, got {count}")
    device, kernel, rows = torch.device(device), _triton_kernel(), []
    for head_dim in head_dims:
        generator = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(1, heads, length, head_dim, device=device, generator=generator) for _ in range(3))
        for causal in (False, True):
            for block_q, block_k in tiles:
                for count in warps:
                    run = partial(kernel.flash_attention_triton, q, k, v, block_q=block_q, block_k=block_k,
                                  causal=causal, num_warps=count)
                    registers = spilled = None
                    if device.type == "cuda":
                        registers, spilled = kernel.compiled_registers(head_dim, block_q=block_q, block_k=block_k,
                                                                       causal=causal, num_warps=count, device=device)
                    rows.append({"head_dim": head_dim, "causal": causal, "tile": (block_q, block_k), "warps": count,
                                 "ms": time_call(run, repeats, warmup=1, device=device) * 1e3,
                                 "registers": registers, "spilled": spilled})
    return rows


def print_triton_tiles(rows: list[dict], length: int, device_name: str) -> None:
    print(f"on {device_name}: full float32 at L = {length}, ms per call (median), the compiled kernel's registers")
    print(f"{'d':>4}{'causal':>8}{'tile':>10}{'warps':>7}{'ms':>10}{'registers':>11}{'spilled':>9}")
    for r in rows:
        tile = f"{r['tile'][0]}x{r['tile'][1]}"
        print(f"{r['head_dim']:>4}{'yes' if r['causal'] else 'no':>8}{tile:>10}{r['warps']:>7}{r['ms']:>10.3f}"
              f"{'-' if r['registers'] is None else r['registers']:>11}{'-' if r['spilled'] is None else r['spilled']:>9}")


def print_triton_rows(rows: list[dict], memory: list[dict], device_name: str) -> None:
    print(f"on {device_name}: ms per call (median), largest |difference| from float64")
    print(f"{'d':>4}{'causal':>8}{'L':>7}{'ieee':>9}{'tf32':>9}{'sdpa fp32':>10}{'sdpa bf16':>10}"
          f"{'ieee diff':>11}{'tf32 diff':>11}")
    for r in rows:
        print(f"{r['head_dim']:>4}{'yes' if r['causal'] else 'no':>8}{r['length']:>7}{r['ieee_ms']:>9.3f}"
              f"{r['tf32_ms']:>9.3f}{r['sdpa_fp32_ms']:>10.3f}{r['sdpa_bf16_ms']:>10.3f}{r['ieee_diff']:>11.1e}"
              f"{r['tf32_diff']:>11.1e}")
    if memory:
        print("\npeak memory above the inputs, MiB (float32, causal)")
        print(f"{'L':>7}{'naive':>10}{'tiled':>10}{'triton':>10}{'sdpa':>10}")
        for r in memory:
            print(f"{r['length']:>7}" + "".join(f"{'not run':>10}" if r[m] is None else f"{r[m]:>10.1f}"
                                                for m in ("naive", "tiled", "triton", "sdpa")))


# ---------------------------------------------------------------- command line

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m course_lib bench",
                                     description="Performance benchmarks (figures are printed, not asserted).")
    # options after the benchmark's name, so `python -m course_lib bench training --threads 2` reaches them
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    common.add_argument("--device", default="cpu", help="cpu (default), cuda or mps")
    sub = parser.add_subparsers(dest="benchmark", required=True)

    training = sub.add_parser("training", parents=[common],
                              help="baseline_cpu for its own steps, then the course's CPU recipes for exactly the "
                                   "baseline's training time")
    training.add_argument("--seconds", type=float,
                          help="give every preset this wall-clock budget instead (default: the first preset "
                               "runs its own steps, the others get the time it took)")
    training.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS), help="presets to run, in order")
    training.add_argument("--out", help="keep each preset's metrics.json and checkpoint.pt under this folder "
                               "(a benchmark replaces the runs it finds there)")
    training.add_argument("--seeds", type=int, nargs="+",
                          help="run the whole comparison once per seed and report each lead's mean and spread "
                               "(default: once, with each preset's own seed)")
    # for tests and smoke runs: another text file, fewer steps
    training.add_argument("--corpus", help=argparse.SUPPRESS)
    training.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    training.add_argument("--peak-sizes", type=int, nargs="+", default=[1024, 2048], help=argparse.SUPPRESS)

    attention = sub.add_parser("attention", parents=[common],
                               help="plain (einsum) vs fused (SDPA) attention, per length")
    attention.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    attention.add_argument("--embed-dim", type=int, nargs="+", default=[w[0] for w in ATTENTION_WIDTHS],
                           help=f"one table per width (default: the CPU recipe's {ATTENTION_WIDTHS[0][0]} and "
                                f"the GPU recipe's {ATTENTION_WIDTHS[1][0]})")
    attention.add_argument("--heads", type=int, nargs="+", default=[w[1] for w in ATTENTION_WIDTHS],
                           help="heads for each --embed-dim, in the same order")
    attention.add_argument("--batch", type=int, help="default: about 4096 tokens per call")
    attention.add_argument("--repeats", type=int, default=15)

    ablation = sub.add_parser("ablation", parents=[common],
                              help="what each change of the CPU recipe bought, at the baseline's own time")
    ablation.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (10 steps each)")
    # for tests and smoke runs: another text file, fewer steps
    ablation.add_argument("--corpus", help=argparse.SUPPRESS)
    ablation.add_argument("--baseline-steps", type=int, help=argparse.SUPPRESS)
    ablation.add_argument("--steps-per-round", type=int, default=10, help=argparse.SUPPRESS)

    nanogpt = sub.add_parser("nanogpt", parents=[common],
                             help="nanoGPT's own Shakespeare recipe, then ours, on the same device (give --device cuda)")
    nanogpt.add_argument("--nanogpt", required=True, metavar="DIR",
                         help="a nanoGPT checkout (git clone https://github.com/karpathy/nanoGPT); it is copied, "
                              "never written to")
    nanogpt.add_argument("--preset", nargs="+", default=["shakespeare_char_gpu"],
                         help="our recipes, run one after the other after nanoGPT's (default: %(default)s)")
    nanogpt.add_argument("--nanogpt-args", default="", metavar="'ARGS'",
                         help="more of nanoGPT's overrides, in one quoted string: '--max_iters=20 --compile=False'")
    nanogpt.add_argument("--course-args", default="", metavar="'ARGS'",
                         help="more words for our train command, in one quoted string: '--steps 20'")
    nanogpt.add_argument("--peak-sizes", type=int, nargs="+", default=[4096, 8192],
                         help="square matmuls for the peak: bf16 on a GPU, fp32 on a CPU (default: %(default)s)")
    nanogpt.add_argument("--corpus", help=argparse.SUPPRESS)

    triton = sub.add_parser("triton", parents=[common],
                            help="notebook 10's Triton kernel against SDPA on a GPU (--device cuda)")
    triton.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    triton.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    triton.add_argument("--heads", type=int, default=16)
    triton.add_argument("--repeats", type=int, default=10)
    triton.add_argument("--tiles", action="store_true",
                        help="instead: full float32 at the first --lengths for each tile shape and warp count, with "
                             "the compiled kernel's registers and spills")
    gen = sub.add_parser("generate", parents=[common], help="tokens/s with and without the KV cache")
    gen.add_argument("--new-tokens", type=int, default=500)
    gen.add_argument("--layers", type=int, default=GENERATION_CONFIG["num_layers"], help=argparse.SUPPRESS)
    gen.add_argument("--embed-dim", type=int, default=GENERATION_CONFIG["embed_dim"], help=argparse.SUPPRESS)
    gen.add_argument("--context", type=int, default=GENERATION_CONFIG["max_tokens"], help=argparse.SUPPRESS)
    return parser


def _nanogpt(args: argparse.Namespace, device: torch.device) -> int:
    import shlex

    from .run_folder import RunRefused
    from .side_by_side import check_nanogpt, print_side_by_side, side_by_side
    try:
        # refused before the peak measurement, not after it
        check_nanogpt(args.nanogpt)
        for name in args.preset:
            validate.one_of("preset", name, sorted(PRESETS))
        nanogpt_args, course_args = shlex.split(args.nanogpt_args), shlex.split(args.course_args)
        validate.int_list("peak_sizes", args.peak_sizes)
        if device.type == "cuda":
            dtype, name = torch.bfloat16, torch.cuda.get_device_name(device)
        else:
            dtype, name = torch.float32, f"{device.type} ({torch.get_num_threads()} threads)"
        peak = measure_matmul_peak(args.peak_sizes, device=device, dtype=dtype) * 1e9
        result = side_by_side(args.nanogpt, preset=args.preset, device=str(device),
                              corpus=args.corpus or "tinyshakespeare", nanogpt_args=nanogpt_args,
                              course_args=course_args, peak_flops=peak)
    except (ValueError, TypeError) as exc:
        raise RunRefused(str(exc)) from None
    print_side_by_side(result, name)
    return 1 if any("error" in course for course in result["courses"]) else 0


def _triton(args: argparse.Namespace, device: torch.device) -> int:
    from .run_folder import RunRefused
    try:
        check_triton_sizes(args.lengths, args.head_dims, args.heads, args.repeats)
    except (ValueError, TypeError) as exc:
        raise RunRefused(str(exc)) from None
    if device.type != "cuda":   # the interpreter's times say nothing about a GPU
        print(f"bench triton: skipped on {device.type}: the compiled kernel needs a CUDA device (--device cuda); "
              f"notebook 10 runs it in Triton's interpreter instead")
        return 0
    try:
        if args.tiles:
            tiles = triton_tile_probe(args.lengths[0], args.head_dims, heads=args.heads, repeats=args.repeats,
                                      device=device)
        else:
            rows = triton_benchmark(args.lengths, args.head_dims, heads=args.heads, repeats=args.repeats, device=device)
            memory = triton_memory_benchmark(args.lengths, device=device)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise RunRefused(str(exc)) from None
    if args.tiles:
        print_triton_tiles(tiles, args.lengths[0], torch.cuda.get_device_name(device))
    else:
        print_triton_rows(rows, memory, torch.cuda.get_device_name(device))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one benchmark from the command line; returns the exit status."""
    from ..train import resolve_device
    from .run_folder import RunRefused
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    try:
        if args.threads is not None:
            torch.set_num_threads(validate.thread_count("threads", args.threads))   # far too many crash torch
        device = resolve_device(args.device)
        if args.benchmark == "attention" and len(args.embed_dim) != len(args.heads):
            raise ValueError(f"heads: expected one value per --embed-dim ({len(args.embed_dim)}), "
                             f"got {len(args.heads)}: {args.heads}")
    except (ValueError, TypeError) as exc:
        raise RunRefused(str(exc)) from None
    if args.benchmark == "training":
        try:
            if args.seconds is not None:   # as `train --seconds` checks it: inf is no budget
                validate.positive_float("seconds", args.seconds, finite=True)
            if args.steps is not None:
                validate.steps("steps", args.steps)
            for name in args.presets:
                validate.one_of("presets", name, sorted(PRESETS))
            for seed in args.seeds or []:
                validate.non_negative_int("seeds", seed)
            if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
                raise ValueError(f"seeds: expected different seeds, got {args.seeds}")
        except ValueError as exc:
            raise RunRefused(str(exc)) from None
        runs = []
        for seed in args.seeds or [None]:
            if seed is not None:
                print(f"seed {seed}:", flush=True)
            out = None if args.out is None else Path(args.out) / (f"seed-{seed}" if args.seeds else "")
            try:
                results = training_benchmark(args.seconds, args.presets, corpus=args.corpus, steps=args.steps,
                                             out_dir=out, device=device, peak_sizes=args.peak_sizes, seed=seed,
                                             verbose=True)
            except BenchStopped as stopped:
                preset, signal_name = stopped.args
                print(f"interrupted: {preset} was stopped ({signal_name or 'a signal'}); the benchmark ends "
                      f"without figures", file=sys.stderr)
                return 143 if signal_name == "SIGTERM" else 130
            _print_training(results, next(iter(results.values()))["peak_gflops"])
            _print_leads(results, args.seconds)
            runs.append(results)
        if len(runs) > 1:
            _print_lead_spread(runs, args.seeds)
        return 0
    if args.benchmark == "ablation":
        from .ablation import ablation_benchmark, print_ablation
        if device.type != "cpu":
            raise RunRefused(f"device: the ablation measures the CPU recipe, so it runs on the CPU; got {device}")
        try:
            rows = ablation_benchmark(corpus=args.corpus, baseline_steps=args.baseline_steps, rounds=args.rounds,
                                      steps_per_round=args.steps_per_round, verbose=True)
        except ValueError as exc:
            raise RunRefused(str(exc)) from None
        print_ablation(rows)
        return 0
    if args.benchmark == "nanogpt":
        return _nanogpt(args, device)
    if args.benchmark == "triton":
        return _triton(args, device)
    if args.benchmark == "attention":
        for i, (embed_dim, heads) in enumerate(zip(args.embed_dim, args.heads)):
            try:   # the sizes are checked where they are used: a wrong one is a refused run, in one line
                rows = attention_benchmark(args.lengths, embed_dim, heads, args.batch, args.repeats, device=device)
            except ValueError as exc:
                raise RunRefused(str(exc).splitlines()[0]) from None
            if i:
                print()
            _print_attention(rows, embed_dim, heads)
        return 0
    config = dict(GENERATION_CONFIG, num_layers=args.layers, embed_dim=args.embed_dim, max_tokens=args.context)
    try:
        result = generation_benchmark(config, args.new_tokens, device=device)
    except ValueError as exc:
        raise RunRefused(str(exc).splitlines()[0]) from None
    _print_generation(result)
    if not result["identical"]:
        print("error: cached and uncached greedy outputs differ", file=sys.stderr)
        return 1
    return 0
