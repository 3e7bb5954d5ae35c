"""Reads the stages' Prometheus endpoints: one scrape per stage, queue depths per hop.

Library module used by `python -m nano_miles.observe.top`, bench/throughput.py and the run's queue recorder.
A stage that does not answer is `None` (down), never an exception.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from nano_miles.observe.metrics import HOP_ENGINE, HOP_REWARD, HOP_TRAINER

STAGES = ("engine", "rollout", "reward", "trainer")
# hop -> (stage that counts sends, stage that counts receipts)
HOP_ENDS = {HOP_ENGINE: ("rollout", "rollout"), HOP_REWARD: ("rollout", "reward"),
            HOP_TRAINER: ("reward", "trainer")}


@dataclass
class Snapshot:
    """One scrape: sample name + labels -> value, and when it was taken."""

    values: dict[tuple[str, tuple], float] = field(default_factory=dict)
    time_s: float = 0.0

    def get(self, name: str, default: float | None = None, **labels: str) -> float | None:
        return self.values.get((name, tuple(sorted(labels.items()))), default)

    def series(self, name: str) -> dict[tuple, float]:
        """Every labelled sample of `name`: sorted (label, value) pairs -> value."""
        return {labels: v for (n, labels), v in self.values.items() if n == name}


def parse(text: str) -> Snapshot:
    snap = Snapshot(time_s=time.time())
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            snap.values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return snap


def scrape(url: str, timeout_s: float = 1.0) -> Snapshot | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return parse(r.read().decode())
    except (OSError, urllib.error.URLError, ValueError):  # refused, timed out, not Prometheus text
        return None


def stage_urls(cfg) -> dict[str, str]:
    """The /metrics URL of every stage (the engine serves it on its HTTP port)."""
    return {"engine": f"{cfg.engine.url}/metrics",
            "rollout": f"http://127.0.0.1:{cfg.rollout.metrics_port}/metrics",
            "reward": f"http://127.0.0.1:{cfg.reward.metrics_port}/metrics",
            "trainer": f"http://127.0.0.1:{cfg.trainer.metrics_port}/metrics"}


def scrape_all(urls: dict[str, str], timeout_s: float = 1.0) -> dict[str, Snapshot | None]:
    return {stage: scrape(url, timeout_s) for stage, url in urls.items()}


def hop_depths(snaps: dict[str, Snapshot | None]) -> dict[str, float | None]:
    """Groups sent but not yet received, per hop; None where an end is down."""
    depths = {}
    for hop, (sender, receiver) in HOP_ENDS.items():
        a, b = snaps.get(sender), snaps.get(receiver)
        if a is None or b is None:
            depths[hop] = None
            continue
        depths[hop] = (a.get("nanomiles_groups_sent_total", 0.0, hop=hop)
                       - b.get("nanomiles_groups_received_total", 0.0, hop=hop))
    return depths


def goodput(snaps: dict[str, Snapshot | None]) -> float | None:
    """Trained / generated response tokens over the run (losses anywhere lower it), as the trainer
    computes it from durable counts: per-process counters would restart with their process."""
    trainer = snaps.get("trainer")
    if trainer is None:
        return None
    return trainer.get("nanomiles_goodput_ratio", 0.0) or None  # 0 until the first step is done
