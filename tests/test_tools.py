"""The calculator tool environment end to end: the taught policy with and without its tool, seeded
conversations, and the chaos test on a multi-turn run (`configs/tools.toml`)."""

import numpy as np
import pytest
import zmq

from conftest import REPO, start_engine, stop_process
from test_chaos import CHAOS, kill_every_stage_twice
from nano_miles.engine.client import EngineClient
from nano_miles.rewards import load_reward
from nano_miles.rewards.worker import RewardWorker
from nano_miles.rollouts.calculator import calculate
from nano_miles.rollouts.tools import parse_call
from nano_miles.run.config import load_config
from nano_miles.stages.rollout.producer import RolloutProducer
from nano_miles.stages.trainer.evaluate import make_evaluator
from nano_miles.tasks import load_problems
from nano_miles.tasks.prompts import encode_prompts, load_tokenizer, stop_token_ids

TOOLS = "configs/tools.toml"
POLICY = REPO / "nano_miles" / "assets" / "policy_tools"
NUM_HELD_OUT = 60
WITHOUT_TOOL = ["--rollout.fn=nano_miles.rollouts.single_turn:rollout", "--task.system_prompt=",
                "--rollout.max_new_tokens=48"]


@pytest.fixture(scope="module")
def tool_engine(tmp_path_factory):
    proc, url = start_engine(POLICY, tmp_path_factory.mktemp("engine") / "engine.log")
    yield url
    stop_process(proc)


def tools_config(*overrides: str):
    return load_config(REPO / TOOLS, [f"--task.train_file={REPO}/examples/word_problems/train.jsonl",
                                      f"--task.test_file={REPO}/examples/word_problems/test.jsonl",
                                      f"--model.path={POLICY}", *overrides])


def held_out_accuracy(url: str, cfg) -> float:
    tokenizer = load_tokenizer(cfg.model_dir)
    worker = RewardWorker(load_reward(cfg.reward), cfg.reward.timeout_s, 2)
    worker.start()
    try:
        evaluate = make_evaluator(cfg, load_problems(cfg, "test"), tokenizer, worker,
                                  stop_token_ids(cfg.model_dir, tokenizer, chat_template=True))
        return evaluate(EngineClient(url), 0, 0.0).accuracy
    finally:
        worker.stop()


def test_the_taught_policy_answers_far_better_with_its_calculator(tool_engine):
    """Greedy held-out accuracy through the pipeline's own evaluation: the tool's rollout against one
    turn without the tool's offer (measured on 100 problems: 51 % against 7 %)."""
    with_tool = held_out_accuracy(tool_engine, tools_config(f"--task.num_test={NUM_HELD_OUT}"))
    without = held_out_accuracy(tool_engine, tools_config(f"--task.num_test={NUM_HELD_OUT}", *WITHOUT_TOOL))
    assert with_tool >= without + 0.25, (with_tool, without)


def test_conversations_are_seeded_and_every_tool_turn_is_the_calculators_answer(tool_engine, tmp_path):
    """The same group drawn twice under one run seed is the same conversation, token for token,
    across both turns; another seed draws another. Each tool turn holds what the calculator answers
    to the call the model's turn before it made."""
    def draw(seed: int):
        cfg = tools_config(f"--engine.port={tool_engine.rsplit(':', 1)[1]}", f"--run.seed={seed}",
                           f"--rollout.control_endpoint=ipc://{tmp_path}/c{seed}", "--rollout.metrics_port=0",
                           f"--reward.endpoint=ipc://{tmp_path}/r{seed}")
        tokenizer = load_tokenizer(cfg.model_dir)
        problems = load_problems(tools_config(), "train")[:2]  # the same two (run.seed shuffles the file)
        ctx = zmq.Context()
        producer = RolloutProducer(cfg, ctx, problems, encode_prompts(tokenizer, problems, cfg.task),
                                   stop_token_ids(cfg.model_dir, tokenizer, chat_template=True), tokenizer)
        try:
            groups = [producer.generate_group(f"e0-i{i}", i) for i in range(2)]
            for g in groups:  # as the producer counts a group it hands on
                producer.metrics.sent(g)
            counted[seed] = {name: producer.metrics.registry.get_sample_value(name) for name in
                             ("nanomiles_model_turns_total", "nanomiles_environment_tokens_total")}
            return groups, tokenizer
        finally:
            producer.close()
            ctx.destroy(linger=0)

    counted = {}
    first, tokenizer = draw(0)
    again, _ = draw(0)
    other, _ = draw(1)
    samples = lambda groups: [g.samples for g in groups]  # noqa: E731 (their timestamps differ)
    assert samples(first) == samples(again) and samples(first) != samples(other)
    num_tool_turns = 0
    for s in (s for g in first for s in g.samples):
        turns = s.turns
        for (a, b, is_model), (c, d, _) in zip(turns, turns[1:]):
            if is_model:  # a model turn followed by the environment's: it called, and heard the answer
                call = parse_call(tokenizer.decode(s.response_tokens[a:b], skip_special_tokens=True))
                tool_turn = tokenizer.decode(s.response_tokens[c:d], skip_special_tokens=True)
                assert tool_turn.split("\n")[2] == calculate(call[1]), tool_turn
                num_tool_turns += 1
        assert (s.versions[~s.model_mask] == -1).all() and (s.logprobs[~s.model_mask] == 0).all()
    assert num_tool_turns >= 8  # of 16 samples: the taught policy calls its tool
    samples_drawn = [s for g in first for s in g.samples]
    assert counted[0] == {"nanomiles_model_turns_total": sum(m for s in samples_drawn for _, _, m in s.turns),
                          "nanomiles_environment_tokens_total": sum(int((~s.model_mask).sum()) for s in samples_drawn)}


@pytest.mark.slow
def test_kill_every_stage_twice_in_a_run_with_tools(tmp_path):
    """The chaos test on the multi-turn run: conversations cut by kills and by weight updates
    mid-turn; every group still trained exactly once, the engine on the final weights."""
    summary = kill_every_stage_twice(tmp_path / "run", [*CHAOS, "--trainer.num_steps=16", "--trainer.batch_groups=4"],
                                     num_steps=16, batch_groups=4, config=TOOLS)
    assert summary["evals"][-1]["accuracy"] is not None
    records = [line for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines() if '"turns"' in line]
    assert records, "no multi-turn sample was trained"
    assert np.isfinite(summary["final_parity"])
