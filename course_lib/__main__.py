"""`python -m course_lib start | doctor | data | train | export | student | grade | autograder | progress | bench`."""
from __future__ import annotations

import argparse
import importlib
import json
import sys


def _train(args: argparse.Namespace) -> int:
    from .runs.presets import RunRequest, run_request
    from .runs.run_folder import command
    from .runs.stopping import exit_status
    from .train import NonFiniteLoss, patience_stop_note
    out = args.resume or args.out
    # the command line's run is the same one value run_preset makes, checked where it is made
    request = RunRequest(args.preset, out, seconds=args.seconds, steps=args.steps, corpus=args.corpus,
                         device=args.device, progress=not args.quiet, compile=args.compile,
                         batch_size=args.batch_size, resume=args.resume is not None, overwrite=args.overwrite)
    try:
        metrics = run_request(request)
    except NonFiniteLoss as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(_interrupted_note(out), file=sys.stderr)
        return 130
    if not metrics:   # only rank 0 reports under torchrun, and a finished run has nothing to do
        return 0
    if metrics["status"] == "stopped" and metrics.get("pending") == "final evaluation":
        print(f"stopped during the final evaluation ({metrics.get('signal', 'signal')}): all {metrics['steps']} "
              f"steps are trained and saved in {out}, but the final validation loss is not measured yet; "
              f"finish it with: {command('--resume', out)}", file=sys.stderr)
        return exit_status(_signal_number(metrics.get("signal")))
    if metrics["status"] == "stopped":
        print(f"stopped at step {metrics['steps']} ({metrics.get('signal', 'signal')}); saved in {out}; "
              f"resume with: {command('--resume', out)}", file=sys.stderr)
        return exit_status(_signal_number(metrics.get("signal")))
    shown = {k: metrics[k] for k in ("preset", "val_loss", "steps", "train_seconds", "tokens_per_second",
                                     "parameters")}
    print(json.dumps(shown, indent=2))
    history, train = metrics["history"], metrics["train"]
    if history["stop_reason"] == "patience":
        print(f"stopped early, at step {metrics['steps']} of {train['steps']}: "
              f"{patience_stop_note(train['patience'], history['best_step'])}")
    print(f"wrote {out}/metrics.json and {out}/checkpoint.pt")
    return 0


def _interrupted_note(out: str) -> str:
    """What an interrupt left on disk, read from the disk itself: the checkpoint is loaded (and so
    verified) before the message calls it intact."""
    from pathlib import Path

    from .checkpoints import load_checkpoint
    from .runs.run_folder import CHECKPOINT, command
    checkpoint = Path(out) / CHECKPOINT
    if not checkpoint.is_file():
        return (f"interrupted: no checkpoint was saved in {out}, so there is nothing to resume; start "
                f"again with: {command('--out', out)} ...")
    try:
        training = load_checkpoint(checkpoint).training
    except Exception as exc:  # whatever is wrong with it, say so rather than call it intact
        return f"interrupted; the checkpoint in {out} cannot be loaded ({exc})"
    if not training:
        return f"interrupted; {checkpoint} holds weights but no training state, so it cannot be resumed"
    return (f"interrupted: anything trained after the last save is not kept; the checkpoint in {out} "
            f"(step {training['step']}) is intact; resume with: {command('--resume', out)}")


def _signal_number(name: str | None) -> int:
    import signal
    return int(getattr(signal, name or "SIGTERM", signal.SIGTERM))


def _data(args: argparse.Namespace) -> int:
    from .corpora import CORPORA, CorpusError, corpus_path
    missing = []
    for name in args.names or list(CORPORA):
        try:
            print(f"{name}: {corpus_path(name, download=not args.no_download)}")
        except (CorpusError, ValueError) as exc:   # not there; a name that is no corpus
            print(f"{name}: {exc}", file=sys.stderr)
            missing.append(name)
    if missing and args.warn_only:
        print(f"WARNING: {', '.join(missing)} not available yet; the notebooks that need "
              f"{'it' if len(missing) == 1 else 'them'} (02, 05-08, 11 and 12) will say so. The fix is above; "
              f"notebooks 01, 03, 04, 09 and 10 need no corpus.", file=sys.stderr)
        return 0
    return 1 if missing else 0


TRAIN_EPILOG = """\
checkpoints: DIR/checkpoint.pt and DIR/metrics.json are written at every evaluation, at least
every few minutes, and at the end, as one unit (the same run_id and step in both). One run at a
time holds DIR (DIR/.course_lib-run.lock names its PID and start time); the OS lets go of it when
that run ends, however it ends.

exit status:
  0    finished (or a resumed run that had already finished); a preset with patience (the GPU
       recipe) finishes early once validation stops improving, on its best weights
  1    stopped by a NaN or infinite loss (the last good checkpoint is kept)
  2    refused before the first step: a bad argument, folder, corpus or device, or a folder
       another run holds
  130  stopped cleanly by Ctrl-C (SIGINT), saved: continue with --resume DIR (after the last
       step, --resume DIR finishes the final evaluation)
  143  stopped cleanly by SIGTERM (SLURM's time limit, kill), saved: as for 130
"""


def build_parser() -> argparse.ArgumentParser:
    from .runs.presets import PRESETS
    parser = argparse.ArgumentParser(prog="python -m course_lib", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    start = sub.add_parser("start", help="write your own copies of the course notebooks into a folder "
                                         "(default ./attention-course); your edits are never overwritten")
    start.add_argument("args", nargs=argparse.REMAINDER)

    sub.add_parser("doctor", help="check that this machine is ready for the workshop")

    data = sub.add_parser("data", help="locate the corpora, downloading any that are missing")
    data.add_argument("names", nargs="*", help="corpora to fetch (default: all)")
    data.add_argument("--no-download", action="store_true", help="only look, never download")
    data.add_argument("--warn-only", action="store_true",
                      help="a corpus that cannot be had is a warning (exit 0), not an error: notebooks "
                           "01, 03, 04, 09 and 10 need none")

    train = sub.add_parser(
        "train", help="train a named preset", epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--preset", choices=sorted(PRESETS), help="the recipe (not needed with --resume)")
    start = train.add_mutually_exclusive_group(required=True)
    start.add_argument("--out", help="folder for checkpoint.pt and metrics.json (kept up to date while training)")
    start.add_argument("--resume", metavar="DIR", help="continue the run saved in DIR from its last checkpoint")
    train.add_argument("--overwrite", action="store_true", help="replace the run that --out already holds")
    budget = train.add_mutually_exclusive_group()
    budget.add_argument("--seconds", type=float, help="the run's training-time budget in seconds")
    budget.add_argument("--steps", type=int, help="the run's total steps (overrides the preset)")
    train.add_argument("--batch-size", type=int, help="sequences per step and per process (overrides the preset)")
    train.add_argument("--corpus", help="a corpus name or the path of any UTF-8 text file")
    train.add_argument("--device", help="cpu, cuda, cuda:N or mps (default: the fastest available)")
    train.add_argument("--compile", action=argparse.BooleanOptionalAction,
                       help="torch.compile the model, or not (default: as the preset says)")
    train.add_argument("--quiet", action="store_true", help="no progress bar")

    export = sub.add_parser("export", help="write a trained run as a Hugging Face folder (GPT runs as GPT-2, "
                                           "ModernGPT runs as Llama, Mistral, Qwen 3, Arcee or Apertus, as its options need) "
                                           "for transformers.pipeline")
    export.add_argument("run_dir", metavar="RUN_DIR", help="the folder a training run wrote (checkpoint.pt)")
    export.add_argument("out_dir", metavar="OUT_DIR", help="a new or empty folder for config.json, "
                                                           "model.safetensors, generation_config.json and the tokenizer")

    student = sub.add_parser("student", help="write learner copies of the notebooks (solutions removed)")
    student.add_argument("args", nargs=argparse.REMAINDER)

    grade = sub.add_parser("grade", help="grade a class's notebooks (sandboxed); write grades, the class's "
                                         "summary and each student's feedback")
    grade.add_argument("args", nargs=argparse.REMAINDER)

    progress = sub.add_parser("progress", help="the live room: per exercise, who passes now and the most "
                                               "common mistake (from COURSE_PROGRESS_DIR)")
    progress.add_argument("args", nargs=argparse.REMAINDER)

    autograder = sub.add_parser("autograder", help="write Gradescope's autograder archive (setup.sh, run_autograder) "
                                                   "that grades each submission with the course's checkers")
    autograder.add_argument("args", nargs=argparse.REMAINDER)

    bench = sub.add_parser("bench", help="benchmarks: training | ablation | attention | generate | triton | nanogpt")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    return parser


# Subcommands with parsers of their own: their arguments (--help included) go straight to them. Each names the
# module (under course_lib) and the function that takes the arguments after the subcommand; imported when used.
DELEGATED = {"grade": ("classroom.grading.cli", "main"), "progress": ("classroom.progress", "main"),
             "autograder": ("classroom.grading.autograder", "main"), "start": ("classroom.assignments", "start_main"),
             "student": ("classroom.assignments", "main"), "bench": ("runs.bench", "main")}


def _delegated(command: str, argv: list[str]) -> int:
    module, function = DELEGATED[command]
    return getattr(importlib.import_module(f".{module}", __package__), function)(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] in DELEGATED:
            return _delegated(argv[0], argv[1:])
        return _run(build_parser().parse_args(argv))
    except Exception as exc:  # only a refused run is shown without its traceback
        from .runs.run_folder import RunRefused
        if not isinstance(exc, RunRefused):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "doctor":
        from .classroom.doctor import run_doctor
        return run_doctor()
    if args.command == "data":
        return _data(args)
    if args.command == "train":
        return _train(args)
    if args.command == "export":
        from .runs.export import main as export_main
        return export_main(args.run_dir, args.out_dir)
    return _delegated(args.command, args.args)   # reached only through build_parser's own callers


if __name__ == "__main__":
    sys.exit(main())
