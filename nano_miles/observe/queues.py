"""Samples every hop's queue depth once a period into <run dir>/queues.jsonl (for the end-of-run plot).

Library module; the trainer's run record starts and stops one `QueueRecorder` thread.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from nano_miles.observe.scrape import hop_depths, scrape_all, stage_urls


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
