"""Metrics endpoints of a real pipeline under supervisord, the hop counters' balance, and the live view.

The pipeline tests share one run and go in file order: running, trainer stopped, reward stopped.
"""

import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.servers import free_port
from harness.supervised_run import SupervisedRun
from nano_miles.observe.metrics import HOP_ENGINE, HOP_REWARD, HOP_TRAINER, RewardMetrics, RolloutMetrics
from nano_miles.observe.scrape import scrape_all, stage_urls
from nano_miles.observe.top import View
from nano_miles.run.config import load_config
from nano_miles.stages.rollout.producer import ProducerState
from nano_miles.wire.data import RolloutGroup, Sample

# Tiny steps that never end by themselves: the tests stop stages to take idle readings.
ENDLESS = ["--trainer.num_steps=100000", "--trainer.batch_groups=2", "--rollout.group_size=2",
           "--trainer.eval_every=0", "--task.num_test=4", "--trainer.checkpoint_every=0",
           "--rollout.max_new_tokens=24"]
EXPECTED = {"engine": ["nanomiles_engine_running_requests", "nanomiles_engine_generated_tokens",
                       "nanomiles_weight_version"],
            "rollout": ["nanomiles_groups_sent", "nanomiles_engine_requests_inflight",
                        "nanomiles_queue_depth_groups", "nanomiles_generate_tokens_per_second"],
            "reward": ["nanomiles_groups_received", "nanomiles_groups_sent", "nanomiles_reward"],
            "trainer": ["nanomiles_staleness_versions", "nanomiles_step_seconds", "nanomiles_trained_tokens",
                        "nanomiles_weight_update_seconds", "nanomiles_goodput_ratio"]}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    run = SupervisedRun(tmp_path_factory.mktemp("metrics") / "run", ENDLESS).start()
    try:
        deadline = time.monotonic() + 120
        while len(run.metrics()) < 2:
            assert time.monotonic() < deadline and run.proc.poll() is None, run.tail()
            time.sleep(0.3)
        yield run, stage_urls(load_config(overrides=run.overrides))
    finally:
        run.stop()


def top_once(run) -> str:
    out = subprocess.run([sys.executable, "-m", "nano_miles.observe.top", "--once", "--run-dir", str(run.run_dir),
                          *run.overrides], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def row(frame: str, first_word: str) -> list[str]:
    return next(line.split() for line in frame.splitlines() if line.startswith(first_word + " "))


def wait_idle(urls, timeout_s: float = 30.0):
    """Scrapes once the producer has nothing in flight and two readings 0.5 s apart agree."""
    deadline, previous = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        snaps = scrape_all(urls)
        key = {s: {k: v for k, v in snap.values.items() if "groups" in k[0] and k[0].endswith("_total")}
               for s, snap in snaps.items() if snap is not None}
        if snaps["rollout"] and snaps["rollout"].get("nanomiles_engine_requests_inflight") == 0 and key == previous:
            return snaps
        previous = key
        time.sleep(0.5)
    raise AssertionError(f"pipeline did not go idle in {timeout_s}s")


@pytest.mark.slow
def test_live_view_of_a_running_pipeline(pipeline):
    run, urls = pipeline
    frame = top_once(run)
    for stage in ("engine", "rollout", "reward", "trainer"):
        assert row(frame, stage)[1] == "up", frame
    assert "last step" in frame and "generate" in frame


@pytest.mark.slow
def test_endpoints_parse_and_hop_counters_add_up(pipeline):
    run, urls = pipeline
    for stage, url in urls.items():
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        names = {f.name for f in text_string_to_metric_families(text)}
        assert set(EXPECTED[stage]) <= names, (stage, sorted(names))
    # per-step records and the trainer's counters describe the same steps (the counters are updated
    # just before a record is written, and groups of the next batch are counted as they arrive)
    before = run.metrics()
    trainer = scrape_all({"trainer": urls["trainer"]})["trainer"]
    after = run.metrics()
    trained = trainer.get("nanomiles_trained_tokens_total")
    assert trained in (sum(r["num_tokens"] for r in before), sum(r["num_tokens"] for r in after[:len(before) + 1]))
    num_accepted = trainer.get("nanomiles_staleness_versions_count")
    assert 2 * len(before) <= num_accepted <= 2 * (len(after) + 1)  # batch_groups = 2

    assert "stopped" in run.ctl("stop", "nanomiles:trainer")
    snaps = wait_idle({s: u for s, u in urls.items() if s != "trainer"})
    rollout, reward = snaps["rollout"], snaps["reward"]
    sent = rollout.get("nanomiles_groups_sent_total", hop=HOP_REWARD)
    assert sent >= 2 * len(before) > 0
    assert reward.get("nanomiles_groups_received_total", hop=HOP_REWARD) == sent
    assert (reward.get("nanomiles_tokens_received_total", hop=HOP_REWARD)
            == rollout.get("nanomiles_tokens_sent_total", hop=HOP_REWARD) > 0)
    assert reward.get("nanomiles_groups_sent_total", hop=HOP_TRAINER) == sent
    assert (rollout.get("nanomiles_groups_sent_total", hop=HOP_ENGINE)
            == rollout.get("nanomiles_groups_received_total", hop=HOP_ENGINE) == sent)


@pytest.mark.slow
def test_live_view_with_a_stage_down(pipeline):
    run, urls = pipeline
    run.ctl("stop", "nanomiles:trainer")  # no-op if stopped already: the producer must be idle
    assert "stopped" in run.ctl("stop", "nanomiles:reward")
    snaps = wait_idle({"rollout": urls["rollout"]})
    frame = top_once(run)
    assert row(frame, "reward")[1] == "down" and row(frame, "trainer")[1] == "down", frame
    assert row(frame, "rollout")[1] == "up" and row(frame, "engine")[1] == "up", frame
    assert row(frame, HOP_REWARD)[1] == "?" and row(frame, HOP_TRAINER)[1] == "?", frame
    assert float(row(frame, HOP_ENGINE)[1]) == snaps["rollout"].get("nanomiles_queue_depth_groups", hop=HOP_ENGINE)


def test_live_view_shows_sent_minus_received():
    """Depths from two real endpoints with known counts: 7 sent, 4 received -> 3 waiting."""
    ports = {s: free_port() for s in ("rollout", "reward", "trainer")}
    cfg = load_config(overrides=[f"--{s}.metrics_port={p}" for s, p in ports.items()]
                      + [f"--engine.port={free_port()}", "--rollout.group_size=1"])
    state = ProducerState()
    rollout, reward = RolloutMetrics(cfg, state), RewardMetrics(cfg)
    sample = Sample(np.arange(5, dtype=np.int32), np.zeros(5, np.float32), np.zeros(5, np.int32), "stop")
    group = RolloutGroup("e0-i0", 0, np.arange(3, dtype=np.int32), [sample],
                         timestamps={"issued": 0.0, "generated": 1.0}, run_id="run-a")
    for _ in range(7):
        rollout.issued()
        rollout.sent(group)
    for _ in range(4):
        reward.received(group)
        reward.sent(SimpleNamespace(group=group, rewards=np.ones(1, np.float32)))
    frame = View(stage_urls(cfg), None, is_color=False).frame()
    assert row(frame, HOP_REWARD)[1] == "3", frame
    assert row(frame, HOP_TRAINER)[1] == "?", frame  # the trainer end is down
    assert row(frame, HOP_ENGINE)[1] == "0", frame   # 7 issued, 7 back
    assert row(frame, "trainer")[1] == "down" and row(frame, "reward")[1] == "up", frame


def test_a_steps_batch_and_loss_figures_reach_metrics_jsonl_prometheus_and_top(tmp_path):
    """One step record built as the trainer builds it: its algorithm figures are in metrics.jsonl's line,
    a skipped optimizer step counts on the Prometheus counter, and `top` shows the batch line."""
    import json

    from nano_miles.algo.diagnostics import LearnResult, LossDiagnostics, StepStats
    from nano_miles.observe.metrics import TrainerMetrics
    from nano_miles.observe.run_record import StepRecord
    from nano_miles.wire.data import ScoredGroup
    samples = [Sample(np.arange(n, dtype=np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32), why)
               for n, why in ((3, "stop"), (8, "length"), (5, "stop"), (5, "stop"))]
    groups = [ScoredGroup(RolloutGroup(f"e0-i{i}", 0, np.arange(3, dtype=np.int32), samples[2 * i:2 * i + 2]),
                          np.array(r, np.float32)) for i, r in enumerate(([1, 0], [1, 1]))]
    learned = LearnResult(pg_loss=0.1, means=LossDiagnostics(clip_fraction=0.25, clip_low_fraction=0.05,
                                                             clip_high_fraction=0.2, ratio_mean=1.01, ratio_max=1.9),
                          num_skipped_steps=2, num_optimizer_steps=2, kl_old=[1e-4, 3e-4])
    stats = StepStats.from_groups(groups, 1, learned, np.array([1.0, -1.0, 0.0, 0.0]))
    record = StepRecord(step=1, version=1, stats=stats, wait_s=0.1, update_split_ms={}, queue_depth=0, goodput=None,
                        num_generated_tokens=21, num_resumed_samples=0, group_ids=["e0-i0", "e0-i1"], drops={})
    line = record.to_json()
    assert (line["response_length_mean"], line["response_length_min"], line["response_length_max"]) == (5.25, 3, 8)
    assert line["truncated_fraction"] == 0.25 and line["zero_std_fraction"] == 0.5
    assert line["advantage_mean"] == 0.0 and line["advantage_std"] == pytest.approx(0.5 ** 0.5)
    assert line["clip_low_fraction"] == 0.05 and line["ratio_max"] == 1.9 and line["kl_old"] == [1e-4, 3e-4]
    cfg = load_config(overrides=[f"--trainer.metrics_port={free_port()}"])
    metrics = TrainerMetrics(cfg, version=lambda: 1)
    metrics.step_done(record)
    assert metrics.registry.get_sample_value("nanomiles_skipped_optimizer_steps_total") == 2
    assert metrics.registry.get_sample_value("nanomiles_clip_high_ratio") == 0.2
    (tmp_path / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    frame = View(stage_urls(cfg), tmp_path, is_color=False).frame()
    batch = next(row for row in frame.splitlines() if row.startswith("batch:"))
    assert "len 5.2 [3-8]" in batch and "trunc 25%" in batch and "zero-std 50%" in batch, batch
    assert "clip low 5.0% high 20.0%" in batch and "kl(old||new) 3.00e-04" in batch and "SKIPPED 2" in batch, batch
