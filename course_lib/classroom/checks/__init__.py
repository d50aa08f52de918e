"""Exercise checkers: each runs a student's code against the course_lib reference and says
which mistake it looks like.  Usage in a notebook: ``checks.check_causal_mask(causal_mask)``.

Exercise X.Y is checked, hinted and registered in ``notebookXX.py`` (``checks.notebook02`` for 2.1).
A check that does not test the student's work (a demonstration on planted buggy code) passes
``graded=False``: under nbgrader it never fails its cell (see ``_nbgrader``).
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
from . import _searches  # noqa: F401 - the counter-example searchers register themselves
from ._core import hint, show_solution
from ._references import bind_references as _bind_references
from .notebook01 import *  # 1.1-1.3 toy and scaled dot-product attention
from .notebook02 import *  # 2.1-2.2 causal mask, masked attention
from .notebook03 import *  # 3.1-3.3 heads, multi-head attention
from .notebook04 import *  # 4.1-4.3 positions, block, GPT
from .notebook05 import *  # 5.1-5.4 windows, loss, train step, sampling
from .notebook06 import *  # 6.1-6.2 FLOPs per token, KV cache
from .notebook07 import *  # 7.1-7.2 Hugging Face
from .notebook08 import *  # 8.1 train your GPT like the reference
from .notebook09 import *  # 9.1-9.6 RoPE, RMSNorm, SwiGLU, repeat_kv, grouped-query attention
from .notebook10 import *  # 10.1-10.3 online softmax, tiled forward, backward by recomputation
from .notebook11 import *  # 11.1-11.3 previous-token and induction scores, ablate_head
from .notebook12 import *  # 12.1-12.3 sliding-window mask, latent attention, recurrent linear attention

# The references the checkers compare against, bound now: a later patch of course_lib by a
# student's notebook is set aside while a check runs (see _harness).
_bind_references()
