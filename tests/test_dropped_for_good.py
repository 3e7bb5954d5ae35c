"""A prompt the engine will never accept (longer than the model's context) is dropped for good with a
counted reason, reported in the ledger, and the producer goes on with the next prompts.

Run: `pytest tests/test_dropped_for_good.py` (a real local engine on the small policy).
"""

import time
from types import SimpleNamespace

import zmq

from nano_miles.engine.client import EngineClient
from nano_miles.observe.run_record import ledger_report
from nano_miles.run.config import load_config
from nano_miles.stages.rollout.producer import RolloutProducer
from nano_miles.tasks import Problem
from nano_miles.wire.control import NO_SIGNAL, ProducerStatus, RestoreState, decode_reply, encode_reply


def test_too_long_prompt_is_dropped_for_good_and_reported(engine_url, tmp_path):
    context_len = int(EngineClient(engine_url).server_info().get("context_length", 2048))
    host, port = engine_url.rsplit(":", 1)
    cfg = load_config(overrides=[f"--engine.port={port}", f"--reward.endpoint=ipc://{tmp_path}/reward.sock",
                                 f"--rollout.control_endpoint=ipc://{tmp_path}/control.sock",
                                 "--rollout.metrics_port=0", "--rollout.group_size=2",
                                 "--rollout.max_new_tokens=4", "--trainer.batch_groups=3", "--task.num_train=5"])
    problems = [Problem("p", str(i)) for i in range(5)]
    prompts = [[5] * (context_len + 10), [5, 6, 7], [8, 9], [10], [11, 12]]
    ctx = zmq.Context()
    producer = RolloutProducer(cfg, ctx, problems, prompts, stop_token_ids=[])
    pull = ctx.socket(zmq.PULL)
    pull.bind(cfg.reward.endpoint)
    try:
        producer.control.run_id = "test-run"  # what the trainer's first `restore` sets
        producer.on_resume(0)
        deadline = time.monotonic() + 60
        while producer.state.num_sent < 3 or producer.state.inflight:
            assert time.monotonic() < deadline, producer.on_status()
            producer.collect()
            producer.flush_outbox()
            while producer.may_issue():
                producer.issue()
            time.sleep(0.01)
        status = producer.on_status()
        assert status["dropped_for_good"] == {"e0-i0": "engine_http_400"}
        assert len(status["dropped_for_good"]) == 1 and status["num_failed"] == 1  # tried once, not retried
        assert producer.metrics.registry.get_sample_value("nanomiles_dropped_for_good_groups_total",
                                                          {"reason": "engine_http_400"}) == 1
        # its slot in the batch went to the next prompt
        assert status["outstanding_group_ids"] == ["e0-i1", "e0-i2", "e0-i3"]
    finally:
        pull.close(linger=0)
        producer.close()
        ctx.term()
    # the end-of-run report lists it as dropped with that reason, not lost
    state = SimpleNamespace(trained_by_step={1: ["e0-i1", "e0-i2", "e0-i3"]}, cursor=4)
    report = ledger_report(state, [], 5, status["dropped_for_good"])
    assert report["prompts"]["e0-i0"] == "dropped: engine_http_400"
    assert report["num_dropped"] == 1 and report["num_lost"] == 0 and report["num_trained_once"] == 3


def test_no_signal_groups_stay_out_of_the_run_and_out_of_the_status(engine_url, tmp_path):
    # A long run of dynamic sampling skips thousands of groups; the trainer keeps their ids, so the
    # status the producer sends back on every commit must not grow with them.
    port = engine_url.rsplit(":", 1)[1]
    cfg = load_config(overrides=[f"--engine.port={port}", f"--reward.endpoint=ipc://{tmp_path}/reward.sock",
                                 f"--rollout.control_endpoint=ipc://{tmp_path}/control.sock",
                                 "--rollout.metrics_port=0", "--task.num_train=2000"])
    problems = [Problem("p", str(i)) for i in range(2000)]
    ctx = zmq.Context()
    producer = RolloutProducer(cfg, ctx, problems, [[5, 6]] * 2000, stop_token_ids=[])
    try:
        issued = [producer.ledger.next_group()[0] for _ in range(1000)]
        skipped = issued[::2]
        status = producer.on_commit(1, issued[1::2], {}, skipped)
        reply = decode_reply(encode_reply("r1", "inc", status))
        assert ProducerStatus.from_result(reply.result).dropped_for_good == {}
        assert producer.ledger.dropped_for_good == dict.fromkeys(skipped, NO_SIGNAL)
        assert producer.metrics.registry.get_sample_value("nanomiles_dropped_for_good_groups_total",
                                                          {"reason": NO_SIGNAL}) == len(skipped)
        # a restarted trainer gets them back, once, in the reply to restore; they are never issued again
        state = RestoreState(step=1, version=1, committed_group_ids=issued[1::2], cursor=1000,
                             num_generated_tokens=0, no_signal_group_ids=skipped[:10])
        reply = decode_reply(encode_reply("r2", "inc", producer.on_restore(state)))
        restored = ProducerStatus.from_result(reply.result)
        assert restored.dropped_for_good == dict.fromkeys(skipped, NO_SIGNAL)
        assert {producer.ledger.next_group()[0] for _ in range(1000)}.isdisjoint(issued)
    finally:
        producer.close()
        ctx.term()
