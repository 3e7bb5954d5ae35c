"""What a run leaves besides metrics.jsonl: optional TensorBoard / W&B step logs, the queue-depth
record (queues.jsonl) and, at the end, PNG plots of reward/accuracy and queue depths.

Library module; the trainer's metrics object owns one `RunArtifacts`. Turn sinks on with
`--metrics.tensorboard=true` or `--metrics.wandb_project=NAME`; a sink whose package is not
installed is skipped with a log line, and nothing else changes.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from nano_miles.metrics_read import HOP_ENDS, hop_depths, scrape_all, stage_urls

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

    def close(self, steps: list[dict]) -> None:
        """Stop the sinks; `steps` (one record per step, as the trainer kept them) feed the plots."""
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, run_dir: Path, config: dict):
        import wandb
        self.run = wandb.init(project=project, dir=str(run_dir), config=config)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, steps: list[dict]) -> None:
        """Stop the sinks; `steps` (one record per step, as the trainer kept them) feed the plots."""
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


class QueueRecorder(threading.Thread):
    """Samples every hop's queue depth each `period_s` into queues.jsonl (for the end-of-run plot)."""

    def __init__(self, cfg, path: Path, period_s: float):
        super().__init__(name="queue-recorder", daemon=True)
        self.urls = {s: u for s, u in stage_urls(cfg).items() if s != "engine"}
        self.path, self.period_s = path, period_s
        self.stopped = threading.Event()

    def run(self) -> None:
        with self.path.open("a") as f:
            while not self.stopped.wait(self.period_s):
                snaps = scrape_all(self.urls, timeout_s=0.5)
                depths = hop_depths(snaps)
                up = [s for s, snap in snaps.items() if snap is not None]
                times = [snap.time_s for snap in snaps.values() if snap is not None]
                if times:
                    f.write(json.dumps({"time": max(times), "depth_groups": depths, "up": up}) + "\n")
                    f.flush()


class RunArtifacts:
    def __init__(self, cfg):
        self.cfg, self.run_dir = cfg, cfg.run_dir
        self.sinks = make_sinks(cfg)
        self.recorder = None
        if cfg.metrics.queue_sample_s > 0:
            self.recorder = QueueRecorder(cfg, self.run_dir / "queues.jsonl", cfg.metrics.queue_sample_s)
            self.recorder.start()

    def log_step(self, record: dict) -> None:
        values = scalars({k: v for k, v in record.items() if k != "step"})
        for sink in self.sinks:
            sink.log(record["step"], values)

    def close(self, steps: list[dict]) -> None:
        """Stop the sinks; `steps` (one record per step, as the trainer kept them) feed the plots."""
        if self.recorder is not None:
            self.recorder.stopped.set()
            self.recorder.join(timeout=5)
        for sink in self.sinks:
            sink.close()
        if self.cfg.metrics.plots:
            write_plots(self.run_dir, steps)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def pyplot_or_none(say=print):
    """matplotlib.pyplot on the file-only Agg backend, or None (after telling `say`) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed (pip install -e '.[bench]'): no PNG written")
        return None
    return plt


def write_plots(run_dir: Path, steps: list[dict]) -> list[Path]:
    """reward_accuracy.png (per step) and queue_depth.png (over time) in the run directory."""
    plt = pyplot_or_none(log.info)
    if plt is None:
        return []
    written = []
    steps = [r for r in steps if "reward" in r]
    if steps:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = [r["step"] for r in steps]
        ax.plot(xs, [r["reward"] for r in steps], label="reward (batch mean)")
        ax.plot(xs, [r["accuracy"] for r in steps], label="accuracy (batch)")
        evals = [(r["step"], r["eval_accuracy"]) for r in steps if "eval_accuracy" in r]
        if evals:
            ax.plot(*zip(*evals), marker="o", ls="--", label="held-out accuracy")
        ax.set_xlabel("step")
        ax.legend()
        fig.tight_layout()
        written.append(run_dir / "reward_accuracy.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    queues = read_jsonl(run_dir / "queues.jsonl")
    if queues:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        t0 = queues[0]["time"]
        for hop in HOP_ENDS:
            points = [(q["time"] - t0, q["depth_groups"].get(hop)) for q in queues]
            ax.plot([t for t, d in points if d is not None], [d for t, d in points if d is not None],
                    label=hop)
        ax.set_xlabel("seconds")
        ax.set_ylabel("groups in the queue")
        ax.legend()
        fig.tight_layout()
        written.append(run_dir / "queue_depth.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    log.info("plots written: %s", ", ".join(p.name for p in written) or "none (no data)")
    return written
