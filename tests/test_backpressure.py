"""Backpressure and hostile input under the real supervisord: a stopped trainer holds the pipeline
still in bounded memory; junk sent into the PULL sockets is counted and the run goes on.

Run: `pytest -m slow tests/test_backpressure.py` (~2-3 min on 2 CPU cores).
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from test_chaos import CHAOS

from harness.supervised_run import SupervisedRun
from nano_miles.observe.metrics import HOP_REWARD
from nano_miles.observe.scrape import scrape
from nano_miles.run.config import load_config
from nano_miles.run.identity import read_run_identity
from nano_miles.wire.codec import MAX_MESSAGE_BYTES
from nano_miles.wire.sockets import ControlClient, make_socket

# the chaos config (default 60 s lease)
SHORT = [o for o in CHAOS if not o.startswith("--trainer.num_steps")]
SETTLE_TIMEOUT_S = 120.0  # bounds a failure to come to rest; the wait ends as soon as the pipeline is at rest
HOLD_S = 20.0             # then it must stay at rest this long: the observation itself
# a stop this long must not look like lost groups
LONG_LEASE = f"--rollout.lease_s={4 * (SETTLE_TIMEOUT_S + HOLD_S):.0f}"
MAX_GROWTH_BYTES = 50 * 1024 * 1024


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def is_at_rest(sample: dict) -> bool:
    """The producer has nothing in flight and waits on the version gate, and the reward stage has taken
    every group the producer sent (neither restarts during the test, so their counters compare)."""
    return (sample["num_inflight"] == 0 and "version gate" in sample["waiting_for"]
            and sample["reward_received"] == sample["num_sent"])


def check_ledger(run: SupervisedRun, num_steps: int) -> dict:
    ledger = json.loads((run.run_dir / "ledger.json").read_text())
    assert ledger["num_lost"] == 0 and ledger["num_trained_twice"] == 0, {k: v for k, v in ledger.items()
                                                                          if k != "prompts"}
    assert sorted(run.steps()) == list(range(1, num_steps + 1))
    return ledger


@pytest.mark.slow
def test_stopped_trainer_holds_the_pipeline_in_bounded_memory(tmp_path):
    num_steps = 10
    run = SupervisedRun(tmp_path / "run", SHORT + [f"--trainer.num_steps={num_steps}", LONG_LEASE]).start()
    cfg = load_config(overrides=run.overrides)
    ctx = zmq.Context()
    samples, producer = [], None
    try:
        run.wait_for_step(3)
        run_id, _ = read_run_identity(run.run_dir)  # the producer answers only its own run
        producer = ControlClient(ctx, cfg.rollout.control_endpoint, run_id=run_id, timeout_s=2.0, retries=3)
        pids = {stage: run.stage_pid(stage) for stage in ("rollout", "reward")}
        assert "stopped" in run.ctl("stop", "nanomiles:trainer")
        stopped = time.monotonic()

        def observe() -> dict:
            status = producer.request("status")
            reward = scrape(f"http://127.0.0.1:{cfg.reward.metrics_port}/metrics")
            samples.append({"t_s": time.monotonic() - stopped, "num_sent": status["num_sent"],
                            "num_inflight": status["num_inflight"], "waiting_for": status["waiting_for"],
                            "reward_received": reward.get("nanomiles_groups_received_total", hop=HOP_REWARD),
                            **{f"{s}_rss": rss_bytes(pid) for s, pid in pids.items()}})
            return samples[-1]

        while not is_at_rest(observe()):
            assert time.monotonic() - stopped < SETTLE_TIMEOUT_S, f"the pipeline never came to rest: {samples[-5:]}"
            time.sleep(0.2)
        at_rest = samples[-1]
        while samples[-1]["t_s"] - at_rest["t_s"] < HOLD_S:
            time.sleep(1.0)  # a sample a second over the hold
            observe()
        assert "STOPPED" in run.ctl("status", "nanomiles:trainer")
        out = subprocess.run([sys.executable, "-m", "nano_miles.observe.status", f"--run.dir={run.run_dir}"],
                             env=run.env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 1, out.stdout + out.stderr  # the trainer is down
        lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
        assert "DOWN" in lines["trainer"] and "version gate" in lines["rollout"], out.stdout
        assert "heartbeat" in lines["rollout"] and "heartbeat" in lines["reward"], out.stdout
        assert " up " in lines["engine"] and " up " in lines["reward"], out.stdout
        assert "STOPPED" in out.stdout and "RUNNING" in out.stdout, out.stdout
        assert {stage: run.stage_pid(stage) for stage in pids} == pids, "a stage restarted under backpressure"
        assert "started" in run.ctl("start", "nanomiles:trainer")
        assert run.wait(timeout_s=600) == 0, run.tail()
    finally:
        if producer is not None:
            producer.close()
        ctx.term()
        run.stop()
    (tmp_path / "backpressure.json").write_text(json.dumps(samples, indent=1))
    first, held = samples[0], [s for s in samples if s["t_s"] >= at_rest["t_s"]]
    for stage in ("rollout", "reward"):
        growth = max(s[f"{stage}_rss"] for s in samples) - first[f"{stage}_rss"]
        assert growth < MAX_GROWTH_BYTES, f"{stage} grew {growth / 2**20:.1f} MiB while the trainer was stopped"
    # once at rest, it stayed there: the producer issued nothing more, reward received nothing more
    assert len(held) > HOLD_S / 2 and all(is_at_rest(s) for s in held), held
    assert {(s["num_sent"], s["reward_received"]) for s in held} == {(at_rest["num_sent"], at_rest["num_sent"])}, held
    check_ledger(run, num_steps)


@pytest.mark.slow
def test_junk_in_the_pull_sockets_is_counted_and_the_run_completes(tmp_path):
    num_steps = 6
    run = SupervisedRun(tmp_path / "run", SHORT + [f"--trainer.num_steps={num_steps}"]).start()
    cfg = load_config(overrides=run.overrides)
    ctx = zmq.Context()
    junk = [b"", b"\x00" * 7, b"\xc1garbage", b"\x81\xa1v\x01", bytes(MAX_MESSAGE_BYTES + 1)]
    try:
        run.wait_for_step(1)
        for endpoint in (cfg.reward.endpoint, cfg.trainer.endpoint):
            push = make_socket(ctx, zmq.PUSH, endpoint, bind=False, send_timeout_ms=10_000)
            for data in junk:
                push.send(data)
            push.close(linger=10_000)  # wait until the junk is delivered
        assert run.wait(timeout_s=600) == 0, run.tail()
    finally:
        ctx.term()
        run.stop()
    reward_log = (run.run_dir / "reward.log").read_text()
    assert reward_log.count("rejected a message") == len(junk), reward_log[-3000:]
    assert run.summary()["drops"].get("malformed") == len(junk), run.summary()["drops"]
    check_ledger(run, num_steps)
