"""Exports a trained model: one checkpoint of a run as a plain Hugging Face model directory.

Run: python -m nano_miles.export RUN_DIR [--step N] OUT

Every checkpoint is already a complete model directory (config, safetensors, generation config,
tokenizer files, chat template); this copies one out without the trainer's own files (optimizer
state, manifest), after checking it against its manifest. The result loads with
`AutoModelForCausalLM.from_pretrained(OUT)` / `AutoTokenizer.from_pretrained(OUT)` and serves with
`python -m sglang.launch_server --model-path OUT`. RUN_DIR may also name a checkpoint directory.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from nano_miles.run.cli import ArgumentParser, UserError, run


def export(source: Path, out: Path, step: int | None = None) -> Path:
    """Copy the checkpoint (newest, or of `step`) of run directory `source` to `out`; returns its path."""
    from nano_miles.stages.trainer.checkpoint import TRAINER_FILES, find_checkpoint

    if step is not None:
        source = source / "checkpoints" / f"step_{step:06d}"
        if not source.is_dir():
            raise UserError(f"--step {step}: no checkpoint {source}")
    checkpoint = find_checkpoint(source, "RUN_DIR")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not empty; name a new directory")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(checkpoint, tmp, ignore=lambda _, names: [n for n in names if n in TRAINER_FILES])
    if out.exists():
        out.rmdir()
    tmp.rename(out)  # whole or not at all
    return checkpoint


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m nano_miles.export", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a run directory (or one checkpoint directory)")
    parser.add_argument("out", type=Path, help="the model directory to write (new, or empty)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest)")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        raise UserError(f"{args.run_dir} is not a directory (a run directory, e.g. runs/current)")
    checkpoint = export(args.run_dir, args.out, args.step)
    print(f"exported {checkpoint} to {args.out}")
    return 0


if __name__ == "__main__":
    run(main, "export")
