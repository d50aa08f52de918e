"""Floating inputs of the wrong dtype and caches of the wrong shape get one clear message naming the
argument at the public boundary, not torch's "expected m1 and m2 to have the same dtype"."""
import pytest
import torch

from course_lib.attention import KVCache, MaskedAttention, MultiHeadMaskedAttention
from course_lib.model import GPT, FeedForward, GPTConfig, TransformerBlock
from course_lib.modern import GroupedQueryAttention, ReLUSquared, SwiGLU
from course_lib.modern_gpt import ModernBlock, ModernGPT, ModernGPTConfig

MODULES = {
    "MaskedAttention": lambda: MaskedAttention(8, 4),
    "MultiHeadMaskedAttention": lambda: MultiHeadMaskedAttention(8, 2, 4),
    "TransformerBlock": lambda: TransformerBlock(8, 2, 4),
    "TransformerBlock post-norm": lambda: TransformerBlock(8, 2, 4, norm_first=False),
    "FeedForward": lambda: FeedForward(8),
    "GroupedQueryAttention": lambda: GroupedQueryAttention(8, 2, 1, 4),
    "SwiGLU": lambda: SwiGLU(8, 16),
    "ReLUSquared": lambda: ReLUSquared(8, 16),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_float32_module_names_x_for_another_floating_dtype(name, dtype):
    module = MODULES[name]()
    with pytest.raises(TypeError, match=rf"x: expected dtype torch.float32 .*, got {dtype}"):
        module(torch.randn(2, 3, 8, dtype=dtype))
    module.to(dtype)   # the module in that dtype takes it
    assert module(torch.randn(2, 3, 8, dtype=dtype)).dtype == dtype


def test_a_modern_block_names_x_too():
    config = ModernGPTConfig(vocab_size=5, max_tokens=4, embed_dim=8, num_heads=2, num_kv_heads=1, num_layers=1)
    with pytest.raises(TypeError, match="x: expected dtype torch.float32"):
        ModernBlock(config)(torch.randn(1, 3, 8, dtype=torch.float64))


def test_autocast_still_mixes_dtypes():
    model = GPT(GPTConfig(vocab_size=5, max_tokens=8, embed_dim=8, num_heads=2, num_layers=2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 5)


def test_a_cache_from_another_model_is_refused_naming_cache():
    gpt = GPT(GPTConfig(vocab_size=5, max_tokens=8, embed_dim=8, num_heads=2, num_layers=2))
    modern = ModernGPT(ModernGPTConfig(vocab_size=5, max_tokens=8, embed_dim=8, num_heads=2, num_kv_heads=1,
                                       num_layers=2))
    cache = modern.new_cache()
    modern(torch.zeros(1, 2, dtype=torch.long), cache)   # filled: 1 key/value head of size 4
    with pytest.raises(ValueError, match=r"cache: holds 1 heads of size 4 .* got 2 heads of size 4"):
        gpt(torch.zeros(1, 1, dtype=torch.long), cache)
    uneven = gpt.new_cache()
    gpt.blocks[0].attn(torch.randn(1, 2, 8), uneven[0])
    with pytest.raises(ValueError, match=r"cache: expected every block's cache to hold the same number"):
        gpt(torch.zeros(1, 1, dtype=torch.long), uneven)
    with pytest.raises(TypeError, match="cache: expected a list of KVCache"):
        gpt(torch.zeros(1, 1, dtype=torch.long), [None, None])
    with pytest.raises(TypeError, match="cache: expected a KVCache or None"):
        gpt.blocks[0].attn(torch.randn(1, 2, 8), cache=[])


def test_kv_cache_append_checks_its_tensors():
    cache = KVCache(8)
    cache.append(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match=r"v: expected the shape of k \(1, 2, 1, 4\)"):
        cache.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 5))
    with pytest.raises(ValueError, match="cache: holds 2 heads of size 4 .*float32.* got 2 heads of size 4 .*float64"):
        cache.append(torch.zeros(1, 2, 1, 4, dtype=torch.float64), torch.zeros(1, 2, 1, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="k: expected a tensor with 4 dimension"):
        cache.append(torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))
    assert cache.length == 3
