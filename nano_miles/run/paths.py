"""What the config's paths must be on disk, looked up at every entry point's start (`parse_config`).

Library module of `config.py`, standard library only: the sections check values alone, so a config
can be built and printed on a machine without these paths; an entry point that reads the config then
finds here, in one line naming the key, a path a stage would trip over later.
"""

from __future__ import annotations

from pathlib import Path

from nano_miles.run.cli import UserError


def check_paths(cfg) -> None:
    """Paths a stage would trip over later, looked up on disk (the sections check values only, so a
    config can be built and printed on a machine without them)."""
    if not (cfg.model_dir / "config.json").is_file():
        raise UserError(f"model.path {str(cfg.model_dir)!r} is not a local HF model directory "
                        "(no config.json there)")
    if cfg.trainer.resume_from and not Path(cfg.trainer.resume_from).is_dir():
        raise UserError(f"trainer.resume_from {cfg.trainer.resume_from!r} is not a directory "
                        "(a checkpoint, or a run directory with checkpoints/)")
    if cfg.security.curve_dir and not (Path(cfg.security.curve_dir) / "allowed").is_dir():
        raise UserError(f"security.curve_dir {cfg.security.curve_dir!r} holds no CURVE keys "
                        "(python -m nano_miles.run.keys DIR makes them)")
