"""Exports a trained model: one checkpoint of a run as a plain Hugging Face model directory.

Run: python -m nano_miles.export RUN_DIR [--step N] [--adapter] OUT

A full fine-tune's checkpoint is already a complete model directory (config, safetensors, generation
config, tokenizer files, chat template); this copies one out without the trainer's own files
(optimizer state, manifest), after checking it against its manifest. A LoRA run's checkpoint holds
adapters: by default they are merged into the base model the checkpoint names (which must still be
there, unchanged) and the merged model is written; `--adapter` writes PEFT's adapter directory
instead (`PeftModel.from_pretrained(base, OUT)`). Either result loads with
`AutoModelForCausalLM.from_pretrained(OUT)` / `AutoTokenizer.from_pretrained(OUT)`; the merged one
serves with `python -m sglang.launch_server --model-path OUT`. RUN_DIR may also name a checkpoint directory.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from nano_miles.run.cli import ArgumentParser, UserError, run


def export(source: Path, out: Path, step: int | None = None, *, adapter: bool = False) -> Path:
    """Write the checkpoint (newest, or of `step`) of run directory `source` to `out` (see the module's
    docstring); returns the checkpoint's path."""
    from nano_miles.stages.trainer.checkpoint import TRAINER_FILES, find_checkpoint, lora_base

    if step is not None:
        source = source / "checkpoints" / f"step_{step:06d}"
        if not source.is_dir():
            raise UserError(f"--step {step}: no checkpoint {source}")
    checkpoint = find_checkpoint(source, "RUN_DIR")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not empty; name a new directory")
    base = lora_base(checkpoint)
    if adapter and base is None:
        raise UserError(f"--adapter: {checkpoint} is a full fine-tune's checkpoint, which holds no adapters")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if base is None or adapter:
        shutil.copytree(checkpoint, tmp, ignore=lambda _, names: [n for n in names if n in TRAINER_FILES])
    else:
        merge(checkpoint, base, tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)  # whole or not at all
    return checkpoint


def merge(checkpoint: Path, base: dict, out: Path) -> None:
    """The base model `base` names with the checkpoint's adapters merged in (fp32), as a model directory."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from nano_miles.stages.trainer.lora import base_identity
    if not Path(base["path"]).is_dir():
        raise UserError(f"{checkpoint}'s adapters were trained on {base['path']}, which is not there any more; "
                        "--adapter writes the adapters alone")
    if base_identity(base["path"])["sha256"] != base["sha256"]:
        raise UserError(f"{base['path']} has changed since {checkpoint}'s adapters were trained on it "
                        "(its SHA-256 differs); --adapter writes the adapters alone")
    model = AutoModelForCausalLM.from_pretrained(base["path"], dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(checkpoint)).merge_and_unload()
    merged.save_pretrained(out)
    for f in checkpoint.iterdir():  # the tokenizer files and chat template, as the checkpoint has them
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) and not (out / f.name).exists():
            shutil.copy(f, out / f.name)


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m nano_miles.export", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a run directory (or one checkpoint directory)")
    parser.add_argument("out", type=Path, help="the model directory to write (new, or empty)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest)")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run: write the adapter directory (PEFT's) instead of the merged model")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        raise UserError(f"{args.run_dir} is not a directory (a run directory, e.g. runs/current)")
    checkpoint = export(args.run_dir, args.out, args.step, adapter=args.adapter)
    print(f"exported {checkpoint} to {args.out}")
    return 0


if __name__ == "__main__":
    run(main, "export")
