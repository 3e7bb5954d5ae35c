"""PNG plots of a run: reward and accuracy per step, queue depth over time.

Library module used by the trainer's run record at the end of a run, and by the bench scripts.
"""

from __future__ import annotations

import logging
from pathlib import Path

from nano_miles.observe.scrape import HOP_ENDS

log = logging.getLogger(__name__)


def pyplot_or_none(say=print):
    """matplotlib.pyplot on the file-only Agg backend; None (after telling `say`) in an environment that
    lacks it (it is a dependency: a run without plots is no reason to stop)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed (pip install matplotlib): no PNG written")
        return None
    return plt


def write_plots(run_dir: Path, steps: list[dict], queues: list[dict]) -> list[Path]:
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
        if all(r.get("accuracy") is not None for r in steps):  # a reward function may have no accuracy
            ax.plot(xs, [r["accuracy"] for r in steps], label="accuracy (batch)")
        for key, label in (("eval_accuracy", "held-out accuracy"), ("eval_reward", "held-out reward")):
            evals = [(r["step"], r[key]) for r in steps if r.get(key) is not None]
            if evals:
                ax.plot(*zip(*evals), marker="o", ls="--", label=label)
        ax.set_xlabel("step")
        written.append(_save(plt, fig, ax, run_dir / "reward_accuracy.png"))
    if queues:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        t0 = queues[0]["time"]
        for hop in HOP_ENDS:
            points = [(q["time"] - t0, q["depth_groups"].get(hop)) for q in queues]
            ax.plot([t for t, d in points if d is not None], [d for t, d in points if d is not None],
                    label=hop)
        ax.set_xlabel("seconds")
        ax.set_ylabel("groups in the queue")
        written.append(_save(plt, fig, ax, run_dir / "queue_depth.png"))
    log.info("plots written: %s", ", ".join(p.name for p in written) or "none (no data)")
    return written


def _save(plt, fig, ax, path: Path) -> Path:
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
