"""`python -m course_lib export RUN_DIR OUT_DIR`: a trained run opens in Hugging Face and generates the same text.

The runs are made here, in a second or two each (a few training steps on a short text); nothing is downloaded.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from course_lib.checkpoints import save_checkpoint
from course_lib.data import CharTokenizer, train_subword_tokenizer
from course_lib.generate import generate_text
from course_lib.model import GPT, GPTConfig
from course_lib.modern_gpt import ModernGPT, ModernGPTConfig
from course_lib.runs.export import ExportRefused, export_run
from course_lib.train import train_step

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n") * 3
FILES = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def make_run(folder: Path, model: torch.nn.Module, tokenizer, steps: int = 40) -> Path:
    """A run folder as `train` writes it: a few steps on TEXT, so greedy choices are clear-cut, not ties."""
    ids = torch.tensor(tokenizer.encode(TEXT))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    length = model.config.max_tokens
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - length - 1, (8,), generator=generator)
        windows = torch.stack([ids[s:s + length + 1] for s in starts.tolist()])   # (8, L + 1)
        train_step(model, optimizer, windows[:, :-1], windows[:, 1:])
    save_checkpoint(folder / "checkpoint.pt", model, tokenizer)
    return folder


def gpt(vocab_size: int, **changes) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, max_tokens=32, embed_dim=32, num_heads=2, num_layers=2, **changes))


def modern(vocab_size: int, **changes) -> ModernGPT:
    torch.manual_seed(0)
    return ModernGPT(ModernGPTConfig(vocab_size=vocab_size, max_tokens=32, embed_dim=32, num_heads=4,
                                     num_kv_heads=2, num_layers=2, **changes))


def assert_same_greedy_text(run: Path, out: Path, model, tokenizer, prompt: str, new: int) -> None:
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out)
    pipe = transformers.pipeline("text-generation", model=str(out), device="cpu")
    theirs = pipe(prompt, max_new_tokens=new, do_sample=False)[0]["generated_text"]
    ours = generate_text(model.eval(), tokenizer, prompt, new, temperature=0)
    assert theirs == ours, (theirs, ours)
    assert type(pipe.model) is type(hf_model)
    # the pipeline's own defaults are greedy too, and stay inside the context
    assert pipe(prompt)[0]["generated_text"] == generate_text(model, tokenizer, prompt,
                                                            model.config.max_tokens // 2, temperature=0)


@pytest.mark.parametrize("unknown", ["error", "skip", "replace"])
def test_a_gpt_run_exports_as_gpt2_with_its_char_tokenizer(tmp_path, unknown):
    tok = CharTokenizer.from_text(TEXT, unknown=unknown)
    model = gpt(tok.vocab_size, bias=True, tie_weights=unknown == "skip")
    run = make_run(tmp_path / "run", model, tok)
    done = export_run(run, tmp_path / "hf")
    assert FILES <= {p.name for p in done.folder.iterdir()} and done.hf_type == "gpt2"
    assert isinstance(transformers.AutoModelForCausalLM.from_pretrained(done.folder), transformers.GPT2LMHeadModel)
    assert json.loads((done.folder / "config.json").read_text())["model_type"] == "gpt2"

    hf_tok = transformers.AutoTokenizer.from_pretrained(done.folder)
    assert hf_tok("hear me\n")["input_ids"] == tok.encode("hear me\n")
    unseen = "hear ~me~"
    if unknown == "error":
        with pytest.raises(Exception, match="Missing"):
            hf_tok(unseen)
    else:
        assert hf_tok(unseen)["input_ids"] == tok.encode(unseen)
    assert_same_greedy_text(run, done.folder, model, tok, "All:\nSpe", 12)


# The ModernGPT's options -> the transformers class that has them (course_lib.hf.families).
MODERN_EXPORTS = {
    "llama": (dict(rope_theta=500.0), transformers.LlamaForCausalLM),
    "qwen3-qk_norm": (dict(qk_norm=True, norm_eps=1e-5), transformers.Qwen3ForCausalLM),
    "qwen3-qk_norm-window8": (dict(qk_norm=True, sliding_window=8, tie_weights=True), transformers.Qwen3ForCausalLM),
    "mistral-window8": (dict(sliding_window=8), transformers.MistralForCausalLM),
    "arcee-relu2": (dict(mlp="relu2"), transformers.ArceeForCausalLM),
    "apertus-relu2-qk_norm": (dict(mlp="relu2", qk_norm=True), transformers.ApertusForCausalLM),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODERN_EXPORTS))
def test_a_modern_run_exports_as_the_family_with_its_options_and_generates_the_same_text(tmp_path, name):
    changes, cls = MODERN_EXPORTS[name]
    tok = CharTokenizer.from_text(TEXT, unknown="replace")
    model = modern(tok.vocab_size, **changes)
    run = make_run(tmp_path / "run", model, tok)
    done = export_run(run, tmp_path / "hf")
    assert done.hf_type == cls.config_class.model_type
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(done.folder)
    assert type(hf_model) is cls
    assert hf_model.config.num_key_value_heads == 2
    assert getattr(hf_model.config, "sliding_window", None) == changes.get("sliding_window")
    hf_tok = transformers.AutoTokenizer.from_pretrained(done.folder)
    assert hf_tok("hear me\n")["input_ids"] == tok.encode("hear me\n")
    ids = torch.tensor([tok.encode(TEXT[:32])])   # 32 tokens: four windows of 8
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, model.eval()(ids), atol=1e-5, rtol=1e-5)
    # 9 + 14 tokens (and the pipeline's default 9 + 16): past a window of 8
    assert_same_greedy_text(run, done.folder, model, tok, "First Cit", 14)


@pytest.mark.slow
def test_a_subword_run_exports_its_tokenizer(tmp_path):
    tok = train_subword_tokenizer(TEXT, vocab_size=300)
    model = modern(len(tok), tie_weights=True)
    run = make_run(tmp_path / "run", model, tok, steps=60)
    done = export_run(run, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(done.folder)
    assert hf_tok("Speak, speak.")["input_ids"] == tok("Speak, speak.")["input_ids"]
    assert hf_tok.eos_token == tok.eos_token
    assert json.loads((done.folder / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id
    assert_same_greedy_text(run, done.folder, model, tok, "You are", 8)


@pytest.mark.parametrize("architecture, changes, setting", [
    ("gpt", {"norm_first": False}, "norm_first"),
    ("modern", {"ngram_prior": 3, "prior_features": True}, "ngram_prior: no transformers architecture"),
    ("modern", {"hashed_ngrams": 3, "qk_norm": True}, "hashed_ngrams: no transformers architecture"),
    ("modern", {"mlp": "relu2", "sliding_window": 8}, "sliding_window: no transformers architecture has both"),
])
def test_what_hf_cannot_express_is_refused_in_one_line_naming_the_setting(tmp_path, architecture, changes, setting):
    tok = CharTokenizer.from_text(TEXT)
    model = (gpt if architecture == "gpt" else modern)(tok.vocab_size, **changes)
    save_checkpoint(tmp_path / "run" / "checkpoint.pt", model, tok)
    with pytest.raises(ExportRefused) as refused:
        export_run(tmp_path / "run", tmp_path / "hf")
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"cannot export {tmp_path / 'run'}: the run's {setting}")
    assert not (tmp_path / "hf").exists() and [p.name for p in tmp_path.iterdir()] == ["run"]   # nothing half-written


def test_bad_folders_are_refused_naming_the_argument(tmp_path):
    with pytest.raises(ExportRefused, match="^RUN_DIR: expected a run folder holding checkpoint.pt"):
        export_run(tmp_path / "nothing", tmp_path / "hf")
    tok = CharTokenizer.from_text(TEXT)
    save_checkpoint(tmp_path / "run" / "checkpoint.pt", gpt(tok.vocab_size), tok)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(ExportRefused, match="^OUT_DIR: .* already holds files"):
        export_run(tmp_path / "run", tmp_path / "full")
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"
    save_checkpoint(tmp_path / "untokenized" / "checkpoint.pt", gpt(10))
    with pytest.raises(ExportRefused, match="saved no tokenizer"):
        export_run(tmp_path / "untokenized", tmp_path / "hf")
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ExportRefused, match="^RUN_DIR: "):
        export_run(tmp_path / "damaged", tmp_path / "hf")


@pytest.mark.slow
def test_the_command_exports_a_trained_preset_and_refuses_in_one_line(tmp_path):
    """The whole path a student takes: `train --preset tiny`, then `export`, then the pipeline."""
    corpus = tmp_path / "text.txt"
    corpus.write_text(TEXT * 4)
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}

    def course(*args):
        return subprocess.run([sys.executable, "-m", "course_lib", *map(str, args)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    trained = course("train", "--preset", "tiny", "--steps", "30", "--corpus", corpus, "--out", "run", "--quiet")
    assert trained.returncode == 0, trained.stderr
    done = course("export", "run", "hf")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("wrote hf as GPT-2 (GPT2LMHeadModel)")
    assert 'transformers.pipeline("text-generation", model="hf")' in done.stdout
    assert FILES <= {p.name for p in (tmp_path / "hf").iterdir()}
    again = course("export", "run", "hf")
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr.count("\n") == 1 and again.stderr.startswith("error: OUT_DIR: hf already holds files")


def test_the_command_names_the_family_it_wrote(tmp_path, capsys):
    from course_lib.runs.export import main

    tok = CharTokenizer.from_text(TEXT)
    save_checkpoint(tmp_path / "run" / "checkpoint.pt", modern(tok.vocab_size, qk_norm=True, sliding_window=8), tok)
    assert main(str(tmp_path / "run"), str(tmp_path / "hf")) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {tmp_path / 'hf'} as Qwen 3 (Qwen3ForCausalLM), ")
    save_checkpoint(tmp_path / "prior" / "checkpoint.pt", modern(tok.vocab_size, ngram_prior=3), tok)
    assert main(str(tmp_path / "prior"), str(tmp_path / "hf2")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: cannot export {tmp_path / 'prior'}: the run's ngram_prior: ")
    assert "mlp='swiglu' converts as Llama" in err
