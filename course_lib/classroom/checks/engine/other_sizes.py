"""The probe at other sizes: the student's code once more at sizes that no case before had (another width, head
count, context, number of layers), beside the reference. A check's cases share their sizes, so a size or a scale
written into the code for them passes every case and shows only here; a failure here says so."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...verdict import Failure, fail
from .._student_code import close, max_diff, reraise_with
from .scale_fit import ScaleFit, fitted_scale


def at_other_sizes(run: Callable[[], torch.Tensor], expected: Callable[[], torch.Tensor], what: str, right_at: str,
                   advice: str, *, scale: tuple[ScaleFit, tuple[Any, ...]] | None = None,
                   diagnose: Callable[[torch.Tensor], None] | None = None) -> None:
    """``run()`` the student's code at the other sizes (``what`` names the call), ``expected()`` the reference's
    output there. ``right_at`` says where the code was right ("at embed_dim=16"), ``advice`` where the sizes come
    from. ``scale``: a ScaleFit and its arguments, to name a factor written in; ``diagnose(out)``: the exercise's
    own diagnosis of a wrong output (a Failure it raises gets the note too)."""
    written = f" Your code is right {right_at}: most likely a size is written into your code. {advice}"
    try:
        out = run()
    except Failure as failure:
        reraise_with(failure, failure.diagnosis, written)
    reference = expected()
    if close(out, reference):
        return
    if diagnose is not None:
        try:
            diagnose(out)
        except Failure as failure:
            reraise_with(failure, failure.diagnosis, written)
    if scale is not None:
        found = fitted_scale(scale[0], [(scale[1], what, out)])
        if found is not None:
            fail("scale", found + written)
    fail("mismatch", f"{what} differs from the reference by up to {max_diff(out, reference):.3g}." + written)
