"""Optional step-scalar sinks: TensorBoard event files and Weights & Biases.

Library module used by the trainer's run record (`run_record.py`). Turn them on with
`--metrics.tensorboard=true` or `--metrics.wandb_project=NAME`; a sink whose package is not installed
is skipped with a log line, and nothing else changes. Every sink has `log(step, values)` and `close()`.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a step record, nested maps flattened with '/' (lists such as group ids skipped)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix + key] = float(value)
    return out


class TensorBoardSink:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package
        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, run_dir: Path, config: dict):
        import wandb
        self.run = wandb.init(project=project, dir=str(run_dir), config=config)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def make_sinks(cfg) -> list:
    sinks = []
    if cfg.metrics.tensorboard:
        try:
            sinks.append(TensorBoardSink(cfg.run_dir))
        except ImportError as e:
            log.warning("TensorBoard sink off: %s (pip install tensorboard)", e)
    if cfg.metrics.wandb_project:
        try:
            sinks.append(WandbSink(cfg.metrics.wandb_project, cfg.run_dir, cfg.to_dict()))
        except ImportError as e:
            log.warning("W&B sink off: %s (pip install wandb)", e)
    return sinks
