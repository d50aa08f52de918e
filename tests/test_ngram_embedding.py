"""Hashed n-gram embeddings: what each position sees, the KV-cache path, learning, and where they are refused."""
import pytest
import torch

from course_lib.checkpoints import load_checkpoint, save_checkpoint
from course_lib.data import CharTokenizer
from course_lib.generate import generate
from course_lib.modern_gpt import ModernGPT, ModernGPTConfig
from course_lib.ngram_embedding import HashedNgramEmbedding

CONFIG = dict(vocab_size=30, max_tokens=16, embed_dim=32, num_heads=4, num_layers=2, mlp="relu2")


def _model(seed=0, drawn=True, **overrides):
    torch.manual_seed(seed)
    model = ModernGPT(ModernGPTConfig(**{**CONFIG, "hashed_ngrams": 4, "ngram_buckets": 64, **overrides}))
    if drawn:   # trained tables are not zero: give every row its own vector
        for table in model.ngram_embedding.tables:
            torch.nn.init.normal_(table.weight)
    return model.eval()


def test_a_fresh_model_with_ngram_tables_is_the_model_without_them():
    torch.manual_seed(0)
    plain = ModernGPT(ModernGPTConfig(**CONFIG)).eval()
    with_ngrams = _model(drawn=False)
    idx = torch.randint(30, (3, 16))
    # the tables start at zero and are drawn last, so every other weight is the same draw
    assert torch.equal(with_ngrams(idx), plain(idx))


def test_each_position_sees_exactly_the_ngrams_that_end_there():
    embed = _model().ngram_embedding
    idx = torch.randint(30, (1, 16), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[0, 6] = (idx[0, 6] + 1) % 30
    moved = (embed(changed) - embed(idx)).abs().sum(-1)[0]    # (16,)
    # the 4-grams ending at 6..9 hold position 6; none before it, none from 10 on
    assert torch.all(moved[:6] == 0) and torch.all(moved[10:] == 0)
    assert torch.all(moved[6:10] > 0)


def test_the_same_ngram_gets_the_same_vector_and_the_start_its_own_row():
    embed = HashedNgramEmbedding(8, max_n=2, buckets=50)
    torch.nn.init.normal_(embed.tables[0].weight)
    idx = torch.tensor([[3, 4, 5, 3, 4]])
    out = embed(idx)[0]
    assert torch.equal(out[1], out[4])                           # "3 4" twice
    assert not torch.equal(out[1], out[2])
    assert torch.equal(out[0], embed.tables[0].weight[50])       # no token before position 0: the last row


def test_generation_with_a_cache_is_generation_without():
    model = _model()
    prompt = torch.randint(30, (2, 5), generator=torch.Generator().manual_seed(2))
    # 30 new tokens run past max_tokens=16, so the window slides and the cache starts again too
    cached = generate(model, prompt, 30, temperature=0, use_cache=True)
    assert torch.equal(cached, generate(model, prompt, 30, temperature=0, use_cache=False))


def test_a_forward_in_pieces_through_the_cache_is_the_whole_forward():
    model = _model()
    idx = torch.randint(30, (2, 12), generator=torch.Generator().manual_seed(3))
    cache = model.new_cache()
    pieces = [model(idx[:, :3], cache), model(idx[:, 3:4], cache), model(idx[:, 4:], cache)]
    assert torch.allclose(torch.cat(pieces, dim=1), model(idx), atol=1e-5)


def test_a_plain_list_of_caches_is_refused_with_the_fix():
    from course_lib.attention import KVCache
    model = _model()
    with pytest.raises(TypeError, match=r"cache: this model looks at n-grams.*model.new_cache\(\)"):
        model(torch.zeros(1, 3, dtype=torch.long), [KVCache(16) for _ in model.blocks])


def test_the_tables_learn():
    model = _model(drawn=False).train()
    idx = torch.randint(30, (4, 16), generator=torch.Generator().manual_seed(4))
    logits = model(idx[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
    for table in model.ngram_embedding.tables:
        # zero tables still get gradients: the rows the batch used, and no others
        used = table.weight.grad.abs().sum(-1) > 0
        assert 0 < int(used.sum()) <= 4 * 15


def test_the_flop_count_leaves_the_lookup_tables_out():
    model = _model()
    tables = sum(p.numel() for p in model.ngram_embedding.parameters())
    assert tables == 3 * 65 * 32
    assert model.num_parameters() - model.num_parameters(include_embeddings=False) == tables


def test_a_checkpoint_keeps_the_tables_and_an_older_config_still_loads(tmp_path):
    model = _model()
    tokenizer = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz.,;!")
    loaded = load_checkpoint(save_checkpoint(tmp_path / "m.pt", model, tokenizer)).model.eval()
    idx = torch.randint(30, (2, 16))
    assert torch.equal(loaded(idx), model(idx))
    older = {k: v for k, v in ModernGPTConfig(**CONFIG).to_dict().items() if k not in ("hashed_ngrams", "ngram_buckets")}
    assert ModernGPTConfig.from_dict(older).hashed_ngrams == 0


@pytest.mark.parametrize("field, value, match", [
    ("hashed_ngrams", 1, "hashed_ngrams: expected 0 .none. or an int >= 2"),
    ("hashed_ngrams", -2, "hashed_ngrams: expected 0"),
    ("hashed_ngrams", True, "hashed_ngrams: expected 0"),
    ("hashed_ngrams", 2.0, "hashed_ngrams: expected 0"),
    ("ngram_buckets", 0, "ngram_buckets: expected a positive int, got 0"),
])
def test_the_config_names_a_bad_ngram_setting(field, value, match):
    with pytest.raises(ValueError, match=match):
        ModernGPTConfig(**{**CONFIG, field: value})


def test_the_embedding_names_a_bad_setting_or_input():
    embed = HashedNgramEmbedding(8, max_n=3, buckets=10)
    with pytest.raises(TypeError, match="idx: expected integer token ids"):
        embed(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"before: expected the last tokens of the same 1 sequences, at most 2"):
        embed(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="max_n: expected an int >= 2"):
        HashedNgramEmbedding(8, max_n=1, buckets=10)
    with pytest.raises(ValueError, match="buckets: expected a positive int"):
        HashedNgramEmbedding(8, max_n=2, buckets=0)


def test_llama_cannot_express_ngram_tables():
    from course_lib.hf.llama import llama_config_from_course
    with pytest.raises(ValueError, match=r"config.hashed_ngrams: a Llama cannot express hashed_ngrams=4"):
        llama_config_from_course(ModernGPTConfig(**{**CONFIG, "mlp": "swiglu", "hashed_ngrams": 4}))
