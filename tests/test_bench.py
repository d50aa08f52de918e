"""The benchmarks measure the right things: correctness only, never speed."""
import contextlib
import io
import re

import pytest
import torch

from course_lib import GPTConfig
from course_lib.runs import PRESETS, bench
from course_lib.train import flops_per_token

# Short lines of varied text: enough characters for a few dozen windows of the small presets.
TEXT = "".join(f"{w} said the {a} to the {b}, and it was {c}.\n"
               for w, a, b, c in zip(["ann", "bob", "cy", "di", "ed", "flo"] * 40,
                                     ["cat", "dog", "owl", "fox", "hen"] * 48,
                                     ["moon", "sea", "king", "queen"] * 60,
                                     ["good", "late", "cold", "odd", "fine", "true"] * 40))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # correctness only: one thread keeps these tests quick on a busy shared CI machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text(TEXT, encoding="utf-8")
    return str(path)


def test_matmul_peak_is_a_positive_speed():
    peak = bench.measure_matmul_peak(sizes=(64, 128), repeats=2)
    assert isinstance(peak, float) and peak > 0
    with pytest.raises(ValueError, match="sizes"):
        bench.measure_matmul_peak(sizes=())


def test_peak_memory_is_reported_in_megabytes():
    # this process holds torch, so it has used more than 10 MB and (surely) less than 1 TB
    assert 10 < bench.peak_memory_mb() < 1e6


def test_fused_and_plain_attention_agree_in_the_benchmark_setup():
    rows = bench.attention_benchmark([8, 24], embed_dim=32, num_heads=4, batch=2, repeats=1)
    assert [r["length"] for r in rows] == [8, 24]
    for r in rows:
        assert r["max_abs_difference"] < 1e-5
        for key in ("plain_forward_ms", "fused_forward_ms", "plain_train_ms", "fused_train_ms"):
            assert r[key] > 0
        assert r["train_ratio"] == pytest.approx(r["plain_train_ms"] / r["fused_train_ms"])
        assert r["core_train_ratio"] == pytest.approx(r["plain_core_train_ms"] / r["fused_core_train_ms"])
    assert "core_train_ratio" not in bench.attention_benchmark([8], 32, 4, batch=1, repeats=1, core=False)[0]


def test_attention_benchmark_keeps_tokens_per_call_when_batch_is_not_given():
    rows = bench.attention_benchmark([8, 32], embed_dim=16, num_heads=2, repeats=1, tokens_per_call=64)
    assert [r["batch"] for r in rows] == [8, 2]
    with pytest.raises(ValueError, match="lengths"):
        bench.attention_benchmark([0])


def test_generation_benchmark_cached_equals_uncached():
    config = GPTConfig(vocab_size=13, max_tokens=16, embed_dim=32, num_heads=4, num_layers=2)
    # 40 new tokens on a context of 16 crosses the window rule (keep the last 8) several times
    result = bench.generation_benchmark(config, new_tokens=40, prompt_tokens=3)
    assert result["identical"] is True
    assert result["cached_ids"].shape == (1, 43)
    assert torch.equal(result["cached_ids"], result["uncached_ids"])
    assert result["speedup"] == pytest.approx(result["cached_tokens_per_second"]
                                              / result["uncached_tokens_per_second"])
    with pytest.raises(TypeError, match="config"):
        bench.generation_benchmark("big", new_tokens=2)


def test_generation_config_is_the_gpu_recipe_size():
    gpu = PRESETS["shakespeare_char_gpu"].model
    for key in ("max_tokens", "embed_dim", "num_heads", "num_layers"):
        assert bench.GENERATION_CONFIG[key] == gpu[key]


def test_flop_formula_on_the_baseline_config():
    # 6 FLOPs per weight per token (2 forward, 4 backward) + 12·n·H·Q·T for attention
    config = GPTConfig(vocab_size=65, **{k: v for k, v in PRESETS["baseline_cpu"].model.items()})
    assert flops_per_token(config, 800_000) == 6 * 800_000 + 12 * 4 * 4 * 32 * 64


def test_training_benchmark_stops_on_the_budget_and_reports_metrics(corpus):
    # baseline_cpu's 2000 steps take minutes: half a second must stop it early
    results = bench.training_benchmark(0.5, ["baseline_cpu"], corpus=corpus, peak_gflops=100.0)
    metrics = results["baseline_cpu"]
    for key in ("val_loss", "steps", "tokens_per_second", "achieved_flops", "share_of_peak", "peak_rss_mb",
                "train_seconds", "parameters"):
        assert key in metrics
    assert 0 < metrics["steps"] < PRESETS["baseline_cpu"].train.steps
    assert metrics["share_of_peak"] == pytest.approx(metrics["achieved_flops"] / 100e9)
    assert metrics["val_loss"] > 0


def test_by_default_every_later_preset_gets_exactly_the_baselines_training_time(corpus):
    results = bench.training_benchmark(None, ["tiny", "baseline_cpu"], corpus=corpus, steps=4, peak_gflops=100.0)
    first, second = results["tiny"], results["baseline_cpu"]
    assert first["steps"] == 4 and first["budget_seconds"] is None
    assert second["budget_seconds"] == first["train_seconds"] > 0
    # the later preset stops on that budget (or on the shared step cap), never runs past it by a step's worth
    assert second["steps"] == 4 or second["train_seconds"] >= second["budget_seconds"]


def test_training_command_ends_with_the_machine_readable_line(corpus, tmp_path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = bench.main(["training", "--steps", "3", "--corpus", corpus,
                             "--peak-sizes", "64", "--out", str(tmp_path / "runs")])
    assert status == 0
    lines = out.getvalue().strip().splitlines()
    for line, name in zip(lines[-2:], ("shakespeare_char_cpu", "shakespeare_char_modern_cpu")):
        assert re.fullmatch(rf"val_loss {name}=\d+\.\d{{4}} baseline=\d+\.\d{{4}} at the baseline's own "
                            r"time \(\d+\.\d s\): -?\d+\.\d{3} lower", line), line
    assert sum(line.startswith("val_loss ") for line in lines) == 2
    assert (tmp_path / "runs" / "baseline_cpu" / "metrics.json").exists()
    assert (tmp_path / "runs" / "shakespeare_char_cpu" / "metrics.json").exists()
    assert (tmp_path / "runs" / "shakespeare_char_modern_cpu" / "metrics.json").exists()


def test_course_command_line_reaches_the_benchmarks_with_their_options(capsys):
    from course_lib.__main__ import main as course_main
    status = course_main(["bench", "generate", "--threads", "1", "--new-tokens", "5", "--layers", "1",
                          "--embed-dim", "12", "--context", "16"])
    assert status == 0
    assert "identical outputs: True" in capsys.readouterr().out


def test_attention_command_prints_one_table_per_width(capsys):
    status = bench.main(["attention", "--lengths", "8", "16", "--embed-dim", "16", "32", "--heads", "2", "4",
                         "--batch", "1", "--repeats", "1", "--threads", "1"])
    assert status == 0
    out = capsys.readouterr().out
    assert "embed_dim=16, num_heads=2" in out and "embed_dim=32, num_heads=4" in out
    assert sum(line.strip().startswith(("8 ", "16 ")) for line in out.splitlines()) == 4   # 2 lengths x 2 widths
    with pytest.raises(ValueError, match="heads: expected one value per --embed-dim"):
        bench.main(["attention", "--lengths", "8", "--embed-dim", "16", "32", "--heads", "2"])


def test_benchmark_sizes_are_the_recipes_sizes():
    from course_lib.runs.bench import ATTENTION_WIDTHS, GENERATION_CONFIG
    cpu, gpu = PRESETS["shakespeare_char_cpu"].model, PRESETS["shakespeare_char_gpu"].model
    assert ATTENTION_WIDTHS == ((cpu["embed_dim"], cpu["num_heads"]), (gpu["embed_dim"], gpu["num_heads"]))
    assert {k: GENERATION_CONFIG[k] for k in ("max_tokens", "embed_dim", "num_heads", "num_layers")} == \
        {k: gpu[k] for k in ("max_tokens", "embed_dim", "num_heads", "num_layers")}


def test_ablation_trains_each_variant_for_the_steps_it_takes_in_the_baselines_time(corpus):
    from dataclasses import replace

    from course_lib.runs.ablation import Variant, ablation_benchmark
    tiny = PRESETS["tiny"]
    variants = [Variant("tiny", tiny),
                Variant("tiny, batch 4x", replace(tiny, train=replace(tiny.train, batch_size=64)))]
    rows = ablation_benchmark(variants, corpus=corpus, baseline_steps=12, rounds=3, steps_per_round=2)
    assert [r["label"] for r in rows] == ["tiny", "tiny, batch 4x"]
    assert rows[0]["steps"] == 12
    # a step on 4x the batch takes longer, so fewer of them fit in the baseline's time
    assert rows[1]["steps"] == max(1, round(rows[0]["budget_seconds"] / rows[1]["seconds_per_step"]))
    assert rows[0]["budget_seconds"] == pytest.approx(12 * rows[0]["seconds_per_step"])
    assert all(0 < r["val_loss"] < 10 for r in rows)


def test_ablation_counts_the_ngrams_inside_the_time_and_scores_every_row_on_the_baselines_windows(corpus):
    from dataclasses import replace

    from course_lib.runs.ablation import Variant, ablation_benchmark
    tiny = PRESETS["tiny"]
    counted = replace(tiny, architecture="modern",
                      model=dict(tiny.model, max_tokens=48, mlp="relu2", ngram_prior=3))
    rows = ablation_benchmark([Variant("tiny", tiny), Variant("tiny, modern, counted 3-grams, context 48", counted)],
                              corpus=corpus, baseline_steps=12, rounds=3, steps_per_round=2)
    budget, second = rows[0]["budget_seconds"], rows[1]
    # counting is training time: what it took leaves fewer seconds for steps
    assert second["setup_seconds"] > 0 and rows[0]["setup_seconds"] == 0
    assert second["steps"] == max(1, round((budget - second["setup_seconds"]) / second["seconds_per_step"]))
    # the same model on the baseline's 32-token windows: another number, since fewer tokens come before each
    assert rows[0]["val_loss_on_first_windows"] == rows[0]["val_loss"]
    assert second["first_windows"] == 32 and second["val_loss_on_first_windows"] != second["val_loss"]


@pytest.mark.slow   # seventeen models of the recipe's sizes, built and stepped: 20 s of CPU
def test_ablation_command_prints_every_change_of_the_recipe(corpus, capsys, monkeypatch):
    from dataclasses import replace

    from course_lib.runs import ablation
    # Every row of the recipe, each model as it is, on one sequence a step and one timed step: what is
    # tested here is the command's wiring (the timing and the budgets are, above, on tiny models).
    one_sequence = [replace(v, preset=replace(v.preset, train=replace(v.preset.train, batch_size=1)))
                    for v in ablation.ABLATION]
    monkeypatch.setattr(ablation, "ABLATION", one_sequence)
    assert bench.main(["ablation", "--corpus", corpus, "--baseline-steps", "2", "--rounds", "1",
                       "--steps-per-round", "1"]) == 0
    out = capsys.readouterr().out
    for variant in one_sequence:
        assert variant.label in out
    assert "the last main row is" in out


def test_a_row_that_names_another_is_compared_with_that_row(capsys):
    from course_lib.runs.ablation import print_ablation

    def row(label, loss, **more):
        return dict(label=label, seconds_per_step=0.1, steps=10, val_loss=loss, val_loss_on_first_windows=loss,
                    first_windows=64, budget_seconds=1.0, setup_seconds=0.0, **more)
    print_ablation([row("base", 2.0), row("start", 1.9), row("parts", 1.7), row("more", 1.5),
                    row("control", 1.75, side=True, against="parts"), row("tried", 1.52, side=True)])
    out = capsys.readouterr().out
    bought = {line.split()[0]: line.split()[4] for line in out.splitlines()[5:9]}
    assert bought == {"parts": "+0.200", "more": "+0.200", "control": "-0.050", "tried": "-0.020"}
    assert "the last main row is 0.500 below the baseline;" in out and "lowest row" not in out


def test_the_summary_gives_the_recipes_lead_and_names_a_side_row_that_ends_lower(capsys):
    from course_lib.runs.ablation import print_ablation
    rows = [dict(label=label, seconds_per_step=0.1, steps=10, val_loss=loss, val_loss_on_first_windows=loss,
                 first_windows=64, budget_seconds=1.0, setup_seconds=0.0, side=side)
            for label, loss, side in (("base", 2.0, False), ("recipe", 1.7, False), ("counted", 1.6, True))]
    print_ablation(rows)
    out = capsys.readouterr().out
    assert "the last main row is 0.300 below the baseline; the lowest row, 'counted', is 0.400 below it" in out


def test_a_row_cannot_name_a_row_that_does_not_come_before_it():
    from course_lib.runs.ablation import ABLATION, Variant, ablation_benchmark
    rows = [Variant("a", PRESETS["tiny"]), Variant("b", PRESETS["tiny"], against="c"), Variant("c", PRESETS["tiny"])]
    with pytest.raises(ValueError, match=r"variants\[1\]\.against: expected the label of an earlier row.*'c'"):
        ablation_benchmark(rows)
    assert sum(v.against is not None for v in ABLATION) == 1   # the control, against the same changes on 09's parts
    control = next(v for v in ABLATION if v.against)
    assert control.against in [v.label for v in ABLATION[:ABLATION.index(control)]]


def test_a_preset_with_another_context_is_also_scored_on_the_first_presets_windows(corpus, tmp_path):
    from course_lib.checkpoints import load_checkpoint
    from course_lib.data import corpus_splits
    from course_lib.train import evaluate
    results = bench.training_benchmark(None, ["tiny", "baseline_cpu", "names_char"], corpus=corpus,
                                       steps=2, peak_gflops=100.0, out_dir=tmp_path)
    assert "val_loss_at_first_windows" not in results["names_char"]   # a shorter context cannot read them
    longer = results["baseline_cpu"]
    assert longer["first_windows"] == PRESETS["tiny"].model["max_tokens"] == 32
    model = load_checkpoint(tmp_path / "baseline_cpu" / "checkpoint.pt").model
    _, _, val = corpus_splits(corpus, 32)
    assert longer["val_loss_at_first_windows"] == pytest.approx(evaluate(model, *val.eval_windows(32)))
    assert longer["val_loss_at_first_windows"] != longer["val_loss"]


def test_training_over_seeds_reports_each_lead_with_its_spread(corpus, capsys):
    status = bench.main(["training", "--steps", "2", "--corpus", corpus, "--peak-sizes", "64",
                         "--presets", "baseline_cpu", "shakespeare_char_cpu", "--seeds", "3", "4"])
    assert status == 0
    out = capsys.readouterr().out
    assert out.count("val_loss shakespeare_char_cpu=") == 2   # one line per seed
    losses = [float(v) for v in re.findall(r"val_loss shakespeare_char_cpu=(\d+\.\d+)", out)]
    assert losses[0] != losses[1], "another seed must give other initial weights and batches"
    assert "over 2 seeds (3, 4):" in out
    assert re.search(r"lead shakespeare_char_cpu over baseline_cpu: mean -?\d+\.\d{4}, sd \d+\.\d{4}, "
                     r"range -?\d+\.\d{4} to -?\d+\.\d{4}", out)


def test_training_refuses_repeated_or_negative_seeds(corpus):
    from course_lib.runs.run_folder import RunRefused
    for seeds in (["3", "3"], ["-1", "2"]):
        with pytest.raises(RunRefused, match="seeds"):
            bench.main(["training", "--steps", "2", "--corpus", corpus, "--seeds", *seeds])


def test_a_seed_changes_the_run_and_the_same_seed_repeats_it(corpus, tmp_path):
    from course_lib.runs import run_preset
    runs = [run_preset("tiny", tmp_path / str(i), steps=3, corpus=corpus, progress=False, seed=seed)
            for i, seed in enumerate((5, 5, 6))]
    assert runs[0]["val_loss"] == runs[1]["val_loss"] != runs[2]["val_loss"]
