"""Fully-async mode: partial rollouts across weight updates, bounded staleness, S = 0 equals sync."""

import threading
import time

import numpy as np
import pytest
import torch
import zmq

from harness.learning_runs import ASYNC, margin
from harness.supervised_run import SupervisedRun
from nano_miles.algo.admission import FUTURE, refusal, staleness
from nano_miles.engine.client import EngineClient
from nano_miles.run.config import load_config
from nano_miles.stages.rollout.producer import RolloutProducer
from nano_miles.tasks.arithmetic import Problem
from nano_miles.weights.tensor_sender import push_weights
from nano_miles.wire.data import decode_rollout

TEMPERATURE = 0.8
MIN_DECODED = 8  # decode steps every sample has had before the cut


def engine_state(engine: EngineClient) -> dict:
    """The local engine's scheduler counters (num_running_reqs, num_forward_steps, is_paused, ...)."""
    return engine.server_info()["internal_states"][0]


def wait_for_engine(engine: EngineClient, condition, what: str, timeout_s: float = 120.0) -> dict:
    """Poll the engine's counters until `condition(state)` holds; the timeout only bounds a failure."""
    deadline = time.monotonic() + timeout_s
    while not condition(state := engine_state(engine)):
        assert time.monotonic() < deadline, f"the engine never {what}: {state}"
        time.sleep(0.02)
    return state


def freeze_mid_sample(engine: EngineClient) -> None:
    """Pause the engine in place once a group's 4 samples run and have decoded MIN_DECODED tokens:
    the cut that follows lands mid-sample. The timeouts only bound a failure."""
    started = wait_for_engine(engine, lambda s: s["num_running_reqs"] == 4, "ran the group's 4 samples")
    wait_for_engine(engine, lambda s: s["num_forward_steps"] >= started["num_forward_steps"] + MIN_DECODED,
                    f"decoded {MIN_DECODED} steps")
    engine.pause("in_place")
    frozen = engine_state(engine)
    assert frozen["is_paused"] and frozen["num_running_reqs"] == 4, f"samples finished before the cut: {frozen}"


def producer_for(url: str, tmp_path, prompt: list[int]) -> tuple[RolloutProducer, zmq.Context]:
    cfg = load_config(overrides=[
        f"--engine.port={url.rsplit(':', 1)[1]}", "--rollout.group_size=4", "--rollout.max_new_tokens=400",
        f"--rollout.temperature={TEMPERATURE}", f"--rollout.control_endpoint=ipc://{tmp_path}/c",
        f"--reward.endpoint=ipc://{tmp_path}/r", "--rollout.metrics_port=0"])  # not the default 9101
    ctx = zmq.Context()
    return RolloutProducer(cfg, ctx, [Problem("p", "0")], [prompt], stop_token_ids=[]), ctx


def test_partial_rollout_resumes_across_a_weight_update(long_talker, tmp_path):
    model, url = long_talker
    prompt = [5, 6, 7, 8, 9]
    producer, ctx = producer_for(url, tmp_path, prompt)
    engine = EngineClient(url)
    result = {}
    worker = threading.Thread(target=lambda: result.update(group=producer.generate_group("e0-i0", 0)))
    worker.start()
    freeze_mid_sample(engine)
    old_state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.pause("abort")          # the 4 running samples come back partial...
    push_weights(engine, model, 1)
    engine.resume()                # ...and are resumed under version 1
    worker.join(timeout=120)
    assert not worker.is_alive() and "group" in result, "the group was not finished"
    group = result["group"]
    ctx.destroy(linger=0)
    assert producer.state.num_resumed_samples == 4
    assert "mode=abort, 4 requests aborted" in (tmp_path / "engine.log").read_text()
    new_state = {k: v.clone() for k, v in model.state_dict().items()}
    num_spanning = 0
    for s in group.samples:
        n = len(s.response_tokens)
        assert n == 400 and len(s.logprobs) == n and len(s.versions) == n
        assert s.finish_reason == "length"
        assert np.all(np.diff(s.versions) >= 0) and set(s.versions.tolist()) <= {0, 1}
        num_spanning += len(set(s.versions.tolist())) == 2
        assert np.sum(s.versions == 0) >= MIN_DECODED, "cut before the samples had decoded"
        # No token lost or duplicated at the seam: every token's logprob equals the one the model
        # of its version gives it when the whole sequence is re-read in one forward pass.
        ids = torch.tensor([prompt + s.response_tokens.tolist()])
        for version, state in ((0, old_state), (1, new_state)):
            model.load_state_dict(state)
            with torch.no_grad():
                logits = model(ids[:, :-1]).logits[0, len(prompt) - 1:].float() / TEMPERATURE
            expected = logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None])[:, 0]
            mine = torch.from_numpy(s.versions == version)
            if mine.any():
                gap = (expected[mine] - torch.from_numpy(s.logprobs.copy())[mine]).abs().max().item()
                assert gap < 1e-4, f"version {version} segment disagrees by {gap}"
    assert num_spanning == 4, "a sample was not cut by the update"


def test_partial_rollout_across_a_rollback_is_sent_and_counts_from_its_oldest_version(long_talker, tmp_path):
    """A trainer that restarted from an older checkpoint pushes older weights while samples are cut:
    they resume under a lower version. The producer still encodes and sends the group, the group
    counts from its oldest token, and the restarted trainer refuses its rolled-back tokens."""
    model, url = long_talker
    producer, ctx = producer_for(url, tmp_path, [5, 6, 7, 8, 9])
    engine = EngineClient(url)
    try:
        push_weights(engine, model, 5)
        producer.control.run_id = "run-a"  # what the trainer's `restore` sets
        producer.state.inflight["e0-i0"] = producer.pool.submit(producer.generate_group, "e0-i0", 0)
        freeze_mid_sample(engine)
        engine.pause("abort")
        push_weights(engine, model, 3)  # the restarted trainer's checkpoint of step 3
        engine.resume()
        producer.state.inflight["e0-i0"].result(timeout=120)
        producer.collect()  # encodes the group for the reward stage
        assert not producer.state.inflight and len(producer.outbox) == 1
        group = decode_rollout(producer.outbox[0][1])
    finally:
        producer.close()
        ctx.destroy(linger=0)
    for s in group.samples:
        assert s.versions[0] == 5 and s.versions[-1] == 3 and np.sum(s.versions == 5) >= MIN_DECODED
        assert (s.oldest_version, s.newest_version) == (3, 5)
    assert (group.oldest_version, group.newest_version) == (3, 5)
    # the restarted trainer's step 4 trains version 3: neither fresher than 3 nor admitted with version 5 in it
    assert staleness(4, group.oldest_version) == 0
    assert refusal(4, oldest_version=group.oldest_version, newest_version=group.newest_version, is_consumed=False,
                   max_staleness=2, has_signal=True, skip_zero_variance=False) == FUTURE


SHORT = ["--trainer.num_steps=6", "--trainer.batch_groups=4", "--rollout.group_size=4",
         "--trainer.eval_every=0", "--task.num_test=10"]


@pytest.mark.slow
def test_async_with_zero_staleness_is_sync(tmp_path):
    runs = [SupervisedRun(tmp_path / "sync", SHORT),
            SupervisedRun(tmp_path / "async0", SHORT + ["--run.mode=async", "--run.max_staleness=0"])]
    try:
        for run in runs:
            run.start()
            assert run.wait(timeout_s=300) == 0, run.tail()
    finally:
        for run in runs:
            run.stop()
    sync, async0 = (run.metrics() for run in runs)
    for a, b in zip(sync, async0, strict=True):
        assert sorted(a["group_ids"]) == sorted(b["group_ids"])
        assert a["staleness_max"] == b["staleness_max"] == 0
        assert a["drops"] == b["drops"] and a["num_samples"] == b["num_samples"]


@pytest.mark.slow
def test_async_run_overlaps_stays_bounded_and_learns(tmp_path):
    max_staleness = 2
    assert f"--run.max_staleness={max_staleness}" in ASYNC
    run = SupervisedRun(tmp_path / "run", ASYNC).start()
    try:
        assert run.wait(timeout_s=900) == 0, run.tail()
    finally:
        run.stop()
    records = run.metrics()
    assert all(r["staleness_max"] <= max_staleness for r in records)
    assert any(r["staleness_max"] > 0 for r in records), "the producer never ran ahead"
    s = run.summary()
    # half the smallest gain of five seeds (bench/results/learning_seeds.json), not one lucky run
    assert s["eval_accuracy_max"] - s["eval_accuracy_start"] >= margin("async", "eval_gain"), s


@pytest.mark.slow
def test_async_with_in_place_pauses_keeps_every_sample(tmp_path):
    """pause_mode in_place (the GPU default): the producer keeps sending through each update, the
    engine holds its requests across it; nothing is lost, nothing is cut, versions still gate."""
    max_staleness, num_steps = 1, 8
    run = SupervisedRun(tmp_path / "run", [
        "--run.mode=async", f"--run.max_staleness={max_staleness}", "--run.pause_mode=in_place",
        f"--trainer.num_steps={num_steps}", "--trainer.batch_groups=4", "--rollout.group_size=4",
        "--trainer.eval_every=0", "--task.num_test=10"]).start()
    try:
        assert run.wait(timeout_s=300) == 0, run.tail()
    finally:
        run.stop()
    records = run.metrics()
    assert [r["step"] for r in records] == list(range(1, num_steps + 1))
    assert all(r["staleness_max"] <= max_staleness for r in records)
    assert sum(r["num_resumed_samples"] for r in records) == 0  # no sample was cut and resumed
    s = run.summary()
    assert s["engine_final_version"] == str(num_steps)
    assert s["ledger"]["num_lost"] == 0 and s["ledger"]["num_trained_twice"] == 0
    assert s["ledger"]["num_trained_once"] == num_steps * 4
