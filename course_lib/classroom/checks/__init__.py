"""Exercise checkers: each runs a student's code against the course_lib reference and says
which mistake it looks like.  Usage in a notebook: ``checks.check_causal_mask(causal_mask)``.

Exercise X.Y is declared in ``classroom.exercises`` and checked in ``notebookXX.py`` (``checks.notebook02`` for 2.1).
A check that does not test the student's work (a demonstration on planted buggy code) passes
``graded=False``: under nbgrader it never fails its cell (see ``engine.run``). Every checker the table
``classroom.exercises`` names is imported here by name; nothing registers itself on import.
"""
# The reference modules the checkers compare against, imported before they are bound below.
from ... import attention as _attention
from ... import data as _data
from ... import flash as _flash
from ... import generate as _generate
from ... import model as _model
from ... import modern as _modern
from ... import train as _train
from ..verdict import DIAGNOSES, CheckResult
from ._core import hint, show_solution
from ._references import bind_references as _bind_references
from .notebook01 import check_scaled_dot_product_attention, check_toy_attention, check_toy_prediction
from .notebook02 import check_causal_mask, check_masked_attention
from .notebook03 import check_merge_heads, check_multi_head_attention, check_split_heads
from .notebook04 import check_gpt, check_sinusoidal_table, check_transformer_block
from .notebook05 import check_lm_loss, check_lm_windows, check_sampling, check_train_step
from .notebook06 import check_flops_per_token, check_kv_cache
from .notebook07 import check_hf_attention, check_split_c_attn
from .notebook08 import check_trains_like_reference
from .notebook09 import (
                         check_apply_rotary,
                         check_grouped_query_attention,
                         check_repeat_kv,
                         check_rms_norm,
                         check_rope_tables,
                         check_swiglu,
)
from .notebook10 import check_flash_attention, check_flash_backward, check_online_softmax
from .notebook11 import check_ablate_head, check_induction_score, check_previous_token_score
from .notebook12 import check_latent_attention, check_linear_attention_recurrent, check_sliding_window_mask

# The references the checkers compare against, bound now: a later patch of course_lib by a
# student's notebook is set aside while a check runs (see engine.run).
_bind_references()
