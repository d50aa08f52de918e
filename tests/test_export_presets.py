"""Every preset's architecture opens in transformers.

Each preset's model (random, not trained: nothing is downloaded or trained here) is saved as `train`
saves it and exported; the folder loads with AutoModelForCausalLM and AutoTokenizer offline and gives
the same logits and the same greedy text as the course model. No preset has hashed n-gram tables or a
counted n-gram prior, which no transformers architecture has (test_export: refused in one line naming it).
"""
from __future__ import annotations

import pytest
import torch
import transformers

from course_lib import hf
from course_lib.checkpoints import save_checkpoint
from course_lib.data import CharTokenizer
from course_lib.generate import generate_text
from course_lib.model import GPT
from course_lib.modern_gpt import ARCHITECTURES
from course_lib.runs.export import export_run
from course_lib.runs.presets import PRESETS

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n")
NGRAM_OPTIONS = ("hashed_ngrams", "ngram_prior")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def preset_model(name: str, tok: CharTokenizer, **changes) -> torch.nn.Module:
    preset = PRESETS[name]
    model_class, config_class = ARCHITECTURES[preset.architecture]
    torch.manual_seed(0)
    model = model_class(config_class(vocab_size=tok.vocab_size, **{**preset.model, **changes}))
    # Random weights large enough that every greedy choice is clear-cut (a fresh model's logits are
    # nearly level, and rounding would pick between near-ties).
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(1.0 + 0.1 * noise if p.dim() == 1 else 0.1 * noise)
    return model.eval()


def expected_type(model) -> str:
    """transformers' model_type for the model: GPT-2 for a GPT, else the family its options pick."""
    if isinstance(model, GPT):
        return "gpt2"
    return hf.family_for(model.config).config_class.model_type


def assert_opens_in_transformers(tmp_path, model, tok) -> str:
    save_checkpoint(tmp_path / "run" / "checkpoint.pt", model, tok)
    done = export_run(tmp_path / "run", tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(done.folder)
    hf_tok = transformers.AutoTokenizer.from_pretrained(done.folder)
    ids = hf_tok(TEXT[:model.config.max_tokens], return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == tok.encode(TEXT[:model.config.max_tokens])
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, model(ids), atol=2e-5, rtol=1e-5)
    pipe = transformers.pipeline("text-generation", model=str(done.folder), device="cpu")
    new = min(12, model.config.max_tokens - 6)
    theirs = pipe("All:\nS", max_new_tokens=new, do_sample=False)[0]["generated_text"]
    assert theirs == generate_text(model, tok, "All:\nS", new, temperature=0)
    return done.hf_type


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_opens_in_transformers(tmp_path, name):
    tok = CharTokenizer.from_text(TEXT)
    model = preset_model(name, tok)
    # a counted or hashed n-gram model has no transformers architecture (refused in one line: test_export)
    assert not [option for option in NGRAM_OPTIONS if getattr(model.config, option, 0)], model.config
    assert assert_opens_in_transformers(tmp_path, model, tok) == expected_type(model)
