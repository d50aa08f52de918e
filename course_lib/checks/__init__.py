"""Exercise checkers: each runs a student's code against the course_lib reference and says
which mistake it looks like.  Usage in a notebook: ``checks.check_causal_mask(causal_mask)``."""
# The reference modules the checkers compare against, imported before they are bound below.
from .. import attention as _attention, data as _data, generate as _generate  # noqa: F401
from .. import model as _model, train as _train  # noqa: F401
from ._core import DIAGNOSES, CheckResult, hint, show_solution
from ._harness import bind_references as _bind_references
from .attention_checks import *   # noqa: F401,F403  exercises of notebooks 01-03
from .model_checks import *       # noqa: F401,F403  exercises of notebooks 04-07

# The references the checkers compare against, bound now: a later patch of course_lib by a
# student's notebook is set aside while a check runs (see _harness).
_bind_references()
