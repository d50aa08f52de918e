"""How many bytes each generated token adds to the KV cache, for MHA, GQA, MQA and MLA.

Generation reads the whole cache once per token, so its size per token, times the context length and the
batch, is what limits long contexts and large batches, more than the weights do.
"""
from __future__ import annotations

import torch

from .. import _validate as validate

__all__ = ["ATTENTION_KINDS", "kv_cache_bytes_per_token"]

ATTENTION_KINDS = ("mha", "gqa", "mqa", "mla")
_NEEDS = {"mha": ("num_heads", "head_dim"), "gqa": ("num_kv_heads", "head_dim"), "mqa": ("head_dim",),
          "mla": ("kv_lora_rank", "qk_rope_head_dim")}


def kv_cache_bytes_per_token(attention: str, *, num_layers: int = 1, num_heads: int | None = None,
                             head_dim: int | None = None, num_kv_heads: int | None = None,
                             kv_lora_rank: int | None = None, qk_rope_head_dim: int | None = None,
                             dtype: torch.dtype = torch.float32) -> int:
    """Bytes of cache per token of one sequence, over ``num_layers`` layers, for each kind of ``attention``:

    - ``"mha"``: a key and a value per head, ``2 * num_heads * head_dim`` numbers per layer;
    - ``"gqa"``: a key and a value per key/value head, ``2 * num_kv_heads * head_dim``;
    - ``"mqa"``: one key and one value shared by all heads, ``2 * head_dim``;
    - ``"mla"``: the latent and the shared rotary key, ``kv_lora_rank + qk_rope_head_dim`` (no factor 2:
      keys and values come out of the same latent).

    Each number takes ``dtype``'s size (4 bytes for float32, 2 for bfloat16). Give exactly the sizes the
    kind needs; ``num_heads`` is also accepted (and ignored) for the others, so one set of sizes serves all.
    """
    validate.one_of("attention", attention, ATTENTION_KINDS)
    validate.positive_int("num_layers", num_layers)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype such as torch.float32, got {validate.describe(dtype)}")
    given = {"num_heads": num_heads, "head_dim": head_dim, "num_kv_heads": num_kv_heads,
             "kv_lora_rank": kv_lora_rank, "qk_rope_head_dim": qk_rope_head_dim}
    for name in _NEEDS[attention]:
        if given[name] is None:
            raise ValueError(f"{name}: expected a positive int for attention={attention!r}, got None")
        validate.positive_int(name, given[name])
    for name, value in given.items():
        if value is not None and name not in _NEEDS[attention] and name != "num_heads":
            raise ValueError(f"{name}: not used by attention={attention!r} (it needs {', '.join(_NEEDS[attention])}), "
                             f"got {validate.describe(value)}; leave it out or pick the kind that uses it")
    if num_heads is not None:
        validate.positive_int("num_heads", num_heads)
    if attention == "gqa" and num_heads is not None and num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads: must divide num_heads={num_heads}, got {num_kv_heads}")
    numbers = {"mha": lambda: 2 * num_heads * head_dim, "gqa": lambda: 2 * num_kv_heads * head_dim,
               "mqa": lambda: 2 * head_dim, "mla": lambda: kv_lora_rank + qk_rope_head_dim}[attention]()
    element = torch.empty((), dtype=dtype).element_size()
    return num_layers * numbers * element
