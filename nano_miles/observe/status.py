"""Is each stage up, and what is it waiting for? One look at a running pipeline.

Run: `python -m nano_miles.observe.status [--config FILE] [--section.key=value ...]`; exits 1 when a stage is down.

The producer answers its control channel's `status` (a separate REQ client: the trainer's is not
disturbed), the engine `/health` and `/model_info`, reward and trainer their metrics endpoints; when
the run directory holds supervisord's socket, `supervisorctl status` adds supervisord's view.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import zmq

from nano_miles.engine.client import EngineError
from nano_miles.engine.group import make_engine
from nano_miles.observe.metrics import HOP_REWARD, HOP_TRAINER
from nano_miles.observe.scrape import scrape, stage_urls
from nano_miles.run.cli import ArgumentParser, run
from nano_miles.run.config import Config, parse_config
from nano_miles.run.identity import read_run_identity
from nano_miles.run.liveness import read_heartbeat
from nano_miles.wire.codec import WireError
from nano_miles.wire.control import ProducerStatus
from nano_miles.wire.sockets import ControlClient, ControlError, ControlTimeout

TIMEOUT_S = 2.0


def engine_status(cfg: Config) -> tuple[bool, str]:
    """Every engine (all replicas) healthy, and the weight version they serve (None: they disagree)."""
    engine, urls = make_engine(cfg.engine, timeout_s=TIMEOUT_S), cfg.engine.engine_urls
    if not engine.health(TIMEOUT_S):
        return False, f"no /health answer from {' or '.join(urls)}"
    try:
        info = engine.model_info()
    except (EngineError, OSError) as e:
        return True, f"healthy, /model_info failed: {e}"
    return True, f"serving weight version {info.get('weight_version')}" + (
        f" ({len(urls)} engines)" if len(urls) > 1 else "")


def producer_status(cfg: Config, ctx: zmq.Context) -> tuple[bool, str]:
    # no reply is this row's answer ("DOWN"); the client's retry warning would say it again, untabled
    logging.getLogger(ControlClient.__module__).setLevel(logging.ERROR)
    identity = read_run_identity(cfg.run_dir)  # the producer answers only the run it serves
    client = ControlClient(ctx, cfg.rollout.control_endpoint, run_id=identity[0] if identity else "none",
                           timeout_s=TIMEOUT_S, retries=1)
    try:
        s = ProducerStatus.from_result(client.request("status"))
    except ControlTimeout:
        return False, f"no answer on {cfg.rollout.control_endpoint}"
    except (ControlError, WireError) as e:
        return True, f"answered with an error: {e}"
    finally:
        client.close()
    return True, (f"version {s.version}, {s.num_inflight} groups generating, {s.num_outstanding} "
                  f"outstanding, {s.num_sent} sent; waiting for {s.waiting_for}")


def metrics_status(url: str, what) -> tuple[bool, str]:
    snap = scrape(url, TIMEOUT_S)
    if snap is None:
        return False, f"no answer on {url}"
    return True, what(snap)


def reward_line(snap) -> str:
    received = snap.get("nanomiles_groups_received_total", 0.0, hop=HOP_REWARD)
    sent = snap.get("nanomiles_groups_sent_total", 0.0, hop=HOP_TRAINER)
    failed = sum(snap.series("nanomiles_reward_failures_total").values())
    waiting = "rollout groups" if received == sent else "the trainer to take a scored group"
    return f"{received:.0f} received, {sent:.0f} sent, {failed:.0f} samples failed; waiting for {waiting}"


def trainer_line(snap) -> str:
    return (f"step {snap.get('nanomiles_step', 0.0):.0f}, weight version "
            f"{snap.get('nanomiles_weight_version', -1.0):.0f}, "
            f"{snap.get('nanomiles_groups_received_total', 0.0, hop=HOP_TRAINER):.0f} groups received")


def heartbeat_note(cfg: Config, stage: str) -> str:
    """How long ago the stage's loop last beat: a stage that answers nothing but beats is busy, one
    that has gone silent is stuck (the run's watch restarts it after run.hang_timeout_s)."""
    beat = read_heartbeat(cfg.run_dir, stage)
    if beat is None:
        return ""
    waiting = f", waiting for {beat['waiting_for']}" if beat.get("waiting_for") else ""
    return f" [heartbeat {time.time() - float(beat['time']):.0f}s ago{waiting}]"


def supervisor_view(cfg: Config) -> str | None:
    sock = cfg.run_dir / "supervisor.sock"
    if not sock.exists():
        return None
    try:
        out = subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-s", f"unix://{sock}", "status"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"supervisorctl failed: {e}"
    return (out.stdout + out.stderr).rstrip()


def main(argv: list[str]) -> int:
    cfg, _ = parse_config(argv, ArgumentParser(prog="python -m nano_miles.observe.status", description=__doc__))
    ctx = zmq.Context()
    urls = stage_urls(cfg)
    rows = {"engine": engine_status(cfg), "rollout": producer_status(cfg, ctx),
            "reward": metrics_status(urls["reward"], reward_line),
            "trainer": metrics_status(urls["trainer"], trainer_line)}
    ctx.term()
    for stage, (is_up, text) in rows.items():
        print(f"{stage:<8} {'up' if is_up else 'DOWN':<5} {text}{heartbeat_note(cfg, stage)}")
    view = supervisor_view(cfg)
    if view is not None:
        print("supervisord:\n" + "\n".join("  " + line for line in view.splitlines()))
    return 0 if all(is_up for is_up, _ in rows.values()) else 1


if __name__ == "__main__":
    run(main, "status")
