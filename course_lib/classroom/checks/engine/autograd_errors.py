"""What autograd's own errors mean for a student: the one place that reads their text.

A backward through the graph the student's code built can fail for a few reasons, and each is a mistake of
theirs with a name: a tensor saved for the backward pass changed in place afterwards (``mutation``), a leaf
edited in place, a result cut from its inputs, a graph kept from an earlier call (``gradient``). torch tells
them apart only by the words of its RuntimeError, so those words are matched here, once, and every probe
(the gradient probe, the model-state probe of a context manager, the runner) asks this module.
"""
from __future__ import annotations

from .._student_files import exception_message

# torch: "one of the variables needed for gradient computation has been modified by an inplace operation"
SAVED_TENSOR_CHANGED = "modified by an inplace operation"
# torch: "a leaf Variable that requires grad is being used in an in-place operation." (and "a view of a leaf ...")
_IN_PLACE = (SAVED_TENSOR_CHANGED, "in-place operation")

# Why a graph the student's code built could not be walked back: (autograd's words, verdict, the cause).
CAUSES = (
    (SAVED_TENSOR_CHANGED, "mutation",
     "a tensor that autograd saved for the backward pass was changed in place afterwards (`x += ...`, "
     "`t[...] = ...`, a method ending in `_`, or an edit of a hook's input): make a new tensor instead "
     "(`y = x + ...`, `x = x.clone()` first)"),
    ("does not require grad and does not have a grad_fn", "gradient",
     "your result is not connected to its inputs' graph (a `.detach()`, `.item()`, `.numpy()`, `torch.tensor(...)` "
     "of a result, `torch.no_grad()`, or `requires_grad_(False)` on the way), so no gradient can flow back"),
    ("backward through the graph a second time", "gradient",
     "your code keeps a tensor from an earlier call and builds on it (a cache or a global that outlives one "
     "call), so a second backward meets a graph already freed: compute everything from this call's inputs"),
)


def is_in_place_error(exc: BaseException | str | None) -> bool:
    """Whether autograd refused because something was edited in place: a saved tensor, or a leaf that
    requires grad."""
    text = "" if exc is None else exception_message(exc)
    return any(words in text for words in _IN_PLACE)


def saved_tensor_changed(exc: BaseException | str | None) -> bool:
    """Whether autograd refused because a tensor it saved for the backward pass was changed in place."""
    return exc is not None and SAVED_TENSOR_CHANGED in exception_message(exc)


def named_cause(exc: BaseException | str) -> tuple[str, str] | None:
    """``(verdict, cause in words)`` for an autograd refusal this module can name; None for any other text."""
    text = exception_message(exc)
    for words, diagnosis, cause in CAUSES:
        if words in text:
            return diagnosis, cause
    return None
