"""Interop with Hugging Face transformers: our GPT next to GPT-2, our ModernGPT next to Llama, Mistral,
Qwen 3, Arcee and Apertus, weight for weight.

- :mod:`.gpt2`: ``to_hf_gpt2`` / ``from_hf_gpt2`` convert whole models; the name pairs
  come from :func:`weight_pairs`, the one table both directions read.
- :mod:`.llama`: ``from_hf_llama`` / ``to_hf_llama`` convert a ``LlamaForCausalLM`` to and from the
  course's ``ModernGPT`` (notebook 09), built from any attention, norm and MLP classes with the
  reference's parameter names; the name pairs come from :func:`llama_weight_pairs`.
  ``from_hf_qwen3`` / ``to_hf_qwen3`` (the same module) do the same for ``Qwen3ForCausalLM``: a ModernGPT
  with QK-norm (``qk_norm=True``), with or without a sliding window.
- :mod:`.families`: the table of which transformers decoder expresses which ModernGPT (Llama, Mistral for a
  sliding window, Qwen 3 for QK-norm, Arcee and Apertus for the ReLU² MLP); ``to_hf_modern`` picks the row
  from the config and ``from_hf_modern`` reads any of them.
- :mod:`.pretrained`: ``from_pretrained`` loads real GPT-2 weights (a local folder or
  the hub cache) as a course GPT; ``save_pretrained`` writes a course GPT (as GPT-2) or ModernGPT (as its family) and its
  tokenizer as a folder that ``transformers.pipeline("text-generation", model=folder)`` can run.
- ``course_lib.runs.export`` (beside the run folders it reads) builds on ``save_pretrained``: ``export_run``
  writes a training run's folder as a Hugging Face folder: ``python -m course_lib export RUN_DIR OUT_DIR``.
- :mod:`.attention_interface`: ``course_attention_forward`` is the course's attention in
  transformers' AttentionInterface form; ``register_course_attention`` plugs it into any
  model that uses the interface, and ``run_with_attention`` runs a model with any
  attention function (notebook 07, exercise 7.2).

A leaf: no course_lib module imports it at import time (only its callers do: notebook 07 and the
checks of exercises 7.x), so the rest of the course runs without transformers.
"""
from __future__ import annotations

# The range pyproject.toml declares (a test keeps the two equal); tested with constraints.txt's version.
TRANSFORMERS_REQUIREMENT = ">=5.23"

try:
    import transformers  # noqa: F401  (only to fail early with a useful message)
except ImportError as error:   # pragma: no cover - the course environment always has it
    raise ImportError(f"course_lib.hf needs the transformers package ({TRANSFORMERS_REQUIREMENT}); install the "
                      f"course environment (environment.yml) or `pip install 'transformers{TRANSFORMERS_REQUIREMENT}'`"
                      ) from error

from .attention_interface import course_attention_forward, register_course_attention, run_with_attention
from .families import (
    FAMILIES,
    Family,
    course_config_from_hf,
    family_for,
    from_hf_modern,
    hf_config_from_course,
    modern_weight_pairs,
    to_hf_modern,
)
from .gpt2 import (
    WeightPair,
    course_config_from_gpt2,
    course_to_hf_state_dict,
    from_hf_gpt2,
    gpt2_config_from_course,
    hf_to_course_state_dict,
    split_c_attn,
    to_hf_gpt2,
    weight_pairs,
)
from .llama import (
    course_config_from_llama,
    course_config_from_qwen3,
    from_hf_llama,
    from_hf_qwen3,
    llama_config_from_course,
    llama_weight_pairs,
    qwen3_config_from_course,
    qwen3_weight_pairs,
    to_hf_llama,
    to_hf_qwen3,
)
from .pretrained import PretrainedWeightsNotFound, char_tokenizer_to_hf, from_pretrained, save_pretrained

__all__ = [
    "WeightPair",
    "weight_pairs",
    "split_c_attn",
    "gpt2_config_from_course",
    "course_config_from_gpt2",
    "course_to_hf_state_dict",
    "hf_to_course_state_dict",
    "to_hf_gpt2",
    "from_hf_gpt2",
    "llama_weight_pairs",
    "course_config_from_llama",
    "llama_config_from_course",
    "to_hf_llama",
    "from_hf_llama",
    "qwen3_weight_pairs",
    "course_config_from_qwen3",
    "qwen3_config_from_course",
    "to_hf_qwen3",
    "from_hf_qwen3",
    "Family",
    "FAMILIES",
    "family_for",
    "modern_weight_pairs",
    "hf_config_from_course",
    "course_config_from_hf",
    "to_hf_modern",
    "from_hf_modern",
    "PretrainedWeightsNotFound",
    "from_pretrained",
    "char_tokenizer_to_hf",
    "save_pretrained",
    "course_attention_forward",
    "register_course_attention",
    "run_with_attention",
]
