"""Live terminal view of a running pipeline: stages up/down, queue depths per hop, versions, rates.

Run: python -m nano_miles.observe.top [--config FILE] [--section.key=value ...] [--run-dir DIR]
                              [--interval-s 1.0] [--once]
Reads every stage's /metrics endpoint (ports from the config) and the last line of
<run dir>/metrics.jsonl; `--once` prints one frame without ANSI codes and exits. Ctrl-C quits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import deque
from pathlib import Path

from nano_miles.observe.metrics import HOP_ENGINE
from nano_miles.observe.scrape import HOP_ENDS, STAGES, Snapshot, goodput, hop_depths, scrape_all, stage_urls
from nano_miles.run.cli import ArgumentParser, run

SPARKS = "▁▂▃▄▅▆▇█"
HISTORY_LEN = 40
TAIL_BYTES = 1 << 16  # how much of metrics.jsonl a frame reads: many records
CLEAR = "\033[H\033[2J"
GREEN, RED, BOLD, RESET = "\033[32m", "\033[31m", "\033[1m", "\033[0m"


def sparkline(values) -> str:
    known = [v for v in values if v is not None]
    top = max(known, default=0) or 1
    return "".join(" " if v is None else SPARKS[min(len(SPARKS) - 1, int(v / top * (len(SPARKS) - 1)))]
                   for v in values)


def last_step(run_dir: Path | None) -> dict | None:
    """The newest complete record of metrics.jsonl, read from the file's tail (one record is ~1 KB;
    the file grows all run, and this runs every frame)."""
    path = run_dir / "metrics.jsonl" if run_dir else None
    if path is None or not path.exists():
        return None
    with path.open("rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
        lines = f.read().splitlines()
    for line in reversed(lines):  # the last line may be half written, the first one cut
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def fmt(value, spec: str = ".0f", unknown: str = "?") -> str:
    return unknown if value is None else format(value, spec)


def rate(now: Snapshot | None, before: Snapshot | None, name: str, **labels) -> float | None:
    """Per-second rate of a counter between two scrapes; since process start on the first frame."""
    if now is None:
        return None
    value = now.get(name, 0.0, **labels)
    if before is not None and now.time_s > before.time_s:
        return (value - before.get(name, 0.0, **labels)) / (now.time_s - before.time_s)
    started = now.get("process_start_time_seconds")
    return value / (now.time_s - started) if started and now.time_s > started else None


class View:
    """Keeps the previous scrape (for rates) and each hop's depth history (for the sparklines)."""

    def __init__(self, urls: dict[str, str], run_dir: Path | None, is_color: bool):
        self.urls, self.run_dir, self.is_color = urls, run_dir, is_color
        self.previous: dict[str, Snapshot | None] = {}
        self.history = {hop: deque(maxlen=HISTORY_LEN) for hop in HOP_ENDS}
        self.start_times: dict[str, float] = {}
        self.num_restarts = {stage: 0 for stage in STAGES}

    def paint(self, text: str, color: str) -> str:
        return f"{color}{text}{RESET}" if self.is_color else text

    def frame(self) -> str:
        snaps = scrape_all(self.urls)
        depths = hop_depths(snaps)
        for hop, depth in depths.items():
            self.history[hop].append(depth)
        for stage, snap in snaps.items():
            started = snap.get("process_start_time_seconds") if snap else None
            if started and stage in self.start_times and started != self.start_times[stage]:
                self.num_restarts[stage] += 1
            if started:
                self.start_times[stage] = started
        lines = [self.paint(f"nano-miles top   {time.strftime('%H:%M:%S')}", BOLD), "",
                 f"{'stage':<9}{'state':<7}{'version':>8}{'cpu %':>7}{'restarts':>9}  url"]
        for stage in STAGES:
            snap, before = snaps[stage], self.previous.get(stage)
            state = self.paint(f"{'up' if snap else 'down':<7}", GREEN if snap else RED)
            cpu = rate(snap, before, "process_cpu_seconds_total")
            version = snap.get("nanomiles_weight_version") if snap else None
            lines.append(f"{stage:<9}{state}{fmt(version, '.0f'):>8}{fmt(cpu and 100 * cpu, '.0f'):>7}"
                         f"{self.num_restarts[stage]:>9}  {self.urls[stage]}")
        lines += ["", f"{'hop':<20}{'depth':>6}  history (groups waiting)"]
        for hop, depth in depths.items():
            lines.append(f"{hop:<20}{fmt(depth):>6}  {sparkline(self.history[hop])}")
        record = last_step(self.run_dir)  # read once a frame: the file's tail is 64 KiB
        lines += ["", *self.rates(snaps), "", self.step_line(record), self.algorithm_line(record)]
        self.previous = snaps
        return "\n".join(lines)

    def rates(self, snaps: dict[str, Snapshot | None]) -> list[str]:
        rollout, reward, trainer = snaps["rollout"], snaps["reward"], snaps["trainer"]
        generated = rate(rollout, self.previous.get("rollout"), "nanomiles_tokens_received_total", hop=HOP_ENGINE)
        trained = rate(trainer, self.previous.get("trainer"), "nanomiles_trained_tokens_total")
        inflight = rollout.get("nanomiles_engine_requests_inflight") if rollout else None
        stale = []
        if trainer:
            count = trainer.get("nanomiles_staleness_versions_count", 0.0)
            total = trainer.get("nanomiles_staleness_versions_sum", 0.0)
            stale.append(f"staleness mean {total / count:.2f}" if count else "staleness -")
            drops = {labels[0][1]: v for labels, v in trainer.series("nanomiles_dropped_groups_total").items()}
            stale.append("drops " + (", ".join(f"{k} {v:.0f}" for k, v in sorted(drops.items())) or "0"))
        reward_mean = trainer.get("nanomiles_reward_mean") if trainer else None
        accuracy = trainer.get("nanomiles_accuracy_ratio") if trainer else None
        good = goodput(snaps)
        return [f"generate {fmt(generated, '.1f')} tok/s   train {fmt(trained, '.1f')} tok/s   "
                f"engine requests in flight {fmt(inflight)}   goodput {fmt(good and 100 * good, '.1f')}%",
                f"reward {fmt(reward_mean, '.3f')}   accuracy {fmt(accuracy and 100 * accuracy, '.1f')}%   "
                + "   ".join(stale) + ("" if reward else "   (reward down)")]

    @staticmethod
    def step_line(r: dict | None) -> str:
        if r is None or "reward" not in r:
            return "last step: none yet"
        phases = " ".join(f"{k} {v:.2f}s" for k, v in r.get("phase_s", {}).items())
        acc = "" if r.get("accuracy") is None else f"acc {100 * r['accuracy']:.1f}% | "
        return (f"last step {r['step']} (version {r['version']}): reward {r['reward']:.3f} | "
                f"{acc}step {r['step_s']:.2f}s | {phases}")


    @staticmethod
    def algorithm_line(r: dict | None) -> str:
        """What the last step's batch and loss looked like (lengths, signal, advantages, ratios, clipping)."""
        if r is None or "response_length_mean" not in r:
            return ""
        parts = [f"len {r['response_length_mean']:.1f} [{r['response_length_min']}-{r['response_length_max']}]",
                 f"trunc {100 * r['truncated_fraction']:.0f}%", f"zero-std {100 * r['zero_std_fraction']:.0f}%",
                 f"adv {r['advantage_mean']:+.2f}±{r['advantage_std']:.2f}"]
        if r.get("ratio_mean") is not None:
            parts.append(f"ratio {r['ratio_mean']:.3f} (max {r['ratio_max']:.2f})")
        if r.get("clip_low_fraction") is not None:
            parts.append(f"clip low {100 * r['clip_low_fraction']:.1f}% high {100 * r['clip_high_fraction']:.1f}%")
        if r.get("kl_old"):
            parts.append(f"kl(old||new) {r['kl_old'][-1]:.2e}")
        if r.get("num_skipped_steps"):
            parts.append(f"SKIPPED {r['num_skipped_steps']}")
        return "batch: " + " | ".join(parts)


def positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, not {text!r}")
    return seconds


def main(argv: list[str]) -> int:
    from nano_miles.run.config import parse_config
    parser = ArgumentParser(prog="python -m nano_miles.observe.top", description=__doc__)
    parser.add_argument("--run-dir", type=Path, help="where metrics.jsonl is (default: run.dir)")
    parser.add_argument("--interval-s", type=positive_seconds, default=1.0, help="seconds between frames")
    parser.add_argument("--once", action="store_true", help="print one frame without ANSI codes and exit")
    cfg, args = parse_config(argv, parser)
    view = View(stage_urls(cfg), args.run_dir or cfg.run_dir, is_color=not args.once and sys.stdout.isatty())
    if args.once:
        print(view.frame())
        return 0
    try:
        while True:
            text = view.frame()
            sys.stdout.write(CLEAR + text + "\n")
            sys.stdout.flush()
            time.sleep(args.interval_s)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    run(main, "top")
