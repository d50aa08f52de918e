"""`python -m course_lib export RUN_DIR OUT_DIR`: a trained run as a Hugging Face folder.

The folder holds ``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer
files, so ``AutoModelForCausalLM.from_pretrained`` loads a ``GPT`` run as GPT-2 and a ``ModernGPT``
run as the decoder that has its options (``course_lib.hf.families``: QK-norm as Qwen 3, a sliding
window as Mistral or Qwen 3, the ReLU² MLP as Arcee or Apertus, the rest as Llama),
``AutoTokenizer.from_pretrained`` loads its tokenizer, and
``pipeline("text-generation", model=OUT_DIR)`` decodes greedily to the text ``course_lib.generate``
gives with ``temperature=0`` (within the model's context).

What cannot be exported (a setting no transformers architecture expresses: post-norm GPT blocks,
hashed n-gram tables, a counted n-gram prior, ReLU² with a sliding window; a run without a tokenizer, a
folder that already holds files) is refused with :class:`ExportRefused`, one line naming it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .._atomic import remove_stale_staging, staging_prefix
from ..checkpoints import CheckpointError, load_checkpoint
from .run_folder import CHECKPOINT

__all__ = ["ExportRefused", "Exported", "export_run", "main"]


class ExportRefused(ValueError):
    """A run that cannot be written as a Hugging Face folder; the message names the reason."""


@dataclass(frozen=True)
class Exported:
    folder: Path
    hf_type: str          # transformers' model_type: "gpt2", "llama", "mistral", "qwen3", "arcee" or "apertus"
    parameters: int
    seconds: float


def _checked_out_dir(out_dir: Path) -> None:
    if out_dir.is_symlink():
        # the export is renamed into place: over a link it would replace the link, not fill its target
        target = os.readlink(out_dir)
        what = "a link to nothing" if not out_dir.exists() else "a symbolic link"
        raise ExportRefused(f"OUT_DIR: {out_dir} is {what} (to {target}); name the folder itself, "
                            f"not a link to it")
    limit = _name_max(out_dir.parent)
    room = len(staging_prefix(out_dir.name).encode()) + 8 + len(".tmp")   # the staging folder's longer name
    if len(out_dir.name.encode()) > limit or room > limit:
        raise ExportRefused(f"OUT_DIR: the folder name {out_dir.name[:40]!r}... is {len(out_dir.name.encode())} "
                            f"bytes long; expected at most {limit - (room - len(out_dir.name.encode()))} here "
                            f"(the file system's limit is {limit}, less room for the staging name)")
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportRefused(f"OUT_DIR: expected a folder, got the existing file {out_dir}")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise ExportRefused(f"OUT_DIR: {out_dir} already holds files; export into a new or empty folder "
                            f"(nothing there is replaced)")


def _name_max(folder: Path) -> int:
    """The longest file name the file system under ``folder`` takes (255 where it cannot be asked)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (AttributeError, OSError, ValueError):
        return 255


def _cannot_write(out_dir: Path, exc: OSError) -> ExportRefused:
    return ExportRefused(f"OUT_DIR: cannot write {out_dir} ({exc.strerror or type(exc).__name__}"
                         f"{': ' + exc.filename if isinstance(exc.filename, str) else ''}); choose a folder "
                         f"you can write to, with room for the model")


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Exported:
    """Write the run saved in ``run_dir`` (by ``python -m course_lib train``) as a Hugging Face folder ``out_dir``."""
    for name, value in (("RUN_DIR", run_dir), ("OUT_DIR", out_dir)):
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise ExportRefused(f"{name}: expected a folder path, got {value!r}")
    start = time.perf_counter()
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    checkpoint = run_dir / CHECKPOINT
    if not checkpoint.is_file():
        raise ExportRefused(f"RUN_DIR: expected a run folder holding {CHECKPOINT}, got {run_dir} "
                            f"({'missing' if not run_dir.exists() else 'no ' + CHECKPOINT + ' in it'}); "
                            f"train one with: python -m course_lib train --preset tiny --out {run_dir}")
    try:
        _checked_out_dir(out_dir)
    except OSError as exc:   # a path too long to look up, a folder we may not read
        raise _cannot_write(out_dir, exc) from None
    try:
        saved = load_checkpoint(checkpoint, device="cpu")
    except (CheckpointError, ValueError) as exc:
        raise ExportRefused(f"RUN_DIR: {exc}") from None
    if saved.tokenizer is None:
        raise ExportRefused(f"RUN_DIR: {checkpoint} saved no tokenizer, and a Hugging Face folder needs one; "
                            f"export a run trained with python -m course_lib train")
    from ..hf.pretrained import save_pretrained  # transformers only when exporting: hf is a leaf
    model = saved.model.float().eval()
    # Written beside OUT_DIR, then renamed: an export that fails half-way leaves no half-written folder.
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(out_dir.parent, out_dir.name)   # what an export of this name killed earlier left
        staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=staging_prefix(out_dir.name), suffix=".tmp"))
    except OSError as exc:
        raise _cannot_write(out_dir, exc) from None
    try:
        with torch.no_grad():
            save_pretrained(model, saved.tokenizer, staging)
    except OSError as exc:   # a full disk
        shutil.rmtree(staging, ignore_errors=True)
        raise _cannot_write(out_dir, exc) from None
    except ValueError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        # to_hf_gpt2 / to_hf_modern name the setting: "ours.config.ngram_prior: no transformers architecture ..."
        message = re.sub(r"^(ours\.)?config\.", "", str(exc))
        raise ExportRefused(f"cannot export {run_dir}: the run's {message}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    hf_type = json.loads((staging / "config.json").read_text(encoding="utf-8"))["model_type"]
    try:
        if out_dir.is_dir():
            out_dir.rmdir()   # empty (checked above): the rename needs the name free
        os.replace(staging, out_dir)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise _cannot_write(out_dir, exc) from None
    return Exported(folder=out_dir, hf_type=hf_type,
                    parameters=sum(p.numel() for p in model.parameters()),
                    seconds=time.perf_counter() - start)


def _kinds() -> dict[str, str]:
    """model_type -> what the command line calls it: "Qwen 3 (Qwen3ForCausalLM)"."""
    from ..hf.families import FAMILIES  # transformers only when exporting
    kinds = {"gpt2": "GPT-2 (GPT2LMHeadModel)"}
    kinds.update((f.config_class.model_type, f.label) for f in FAMILIES)
    return kinds


def main(run_dir: str, out_dir: str) -> int:
    """The CLI: 0 written, 2 refused (one line on stderr)."""
    import sys

    import transformers
    transformers.utils.logging.disable_progress_bar()   # one tensor file: a bar for it is noise in the output
    try:
        done = export_run(run_dir, out_dir)
    except ExportRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # the export is staged, then renamed in whole: nothing half-written is left
        from pathlib import Path
        finished = (Path(out_dir) / "config.json").is_file()   # renamed in before the interruption
        print(f"interrupted: {f'the export in {out_dir} was finished' if finished else f'nothing was written to {out_dir}'}",
              file=sys.stderr)
        return 130
    kind = _kinds().get(done.hf_type, done.hf_type)
    print(f"wrote {done.folder} as {kind}, {done.parameters:,} parameters, in {done.seconds:.1f} s")
    print(f"use it with: transformers.pipeline(\"text-generation\", model=\"{done.folder}\")")
    return 0
