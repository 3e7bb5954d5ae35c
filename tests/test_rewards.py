"""The verifiable math reward on a table of responses and labels, several reward functions with weights,
and a reward function with only a "reward" key carried through scoring, the step record and the summary.
Run: pytest tests/test_rewards.py
"""

import os
import time

import numpy as np
import pytest

from nano_miles.algo.diagnostics import LearnResult, LossDiagnostics, StepStats
from nano_miles.observe.run_record import format_step_line, summarize
from nano_miles.rewards import load_reward, sample_facts
from nano_miles.rewards.math import extract_answer, reward
from nano_miles.rewards.worker import RewardWorker
from nano_miles.run.cli import UserError
from nano_miles.run.config import load_config
from nano_miles.run.sections import RewardConfig
from nano_miles.stages.reward.scorer import score_group
from nano_miles.wire.data import RolloutGroup, Sample

GSM8K_LABEL = "Sam has 7*4=28 marbles. Then 28+12=40.\n#### 40"


@pytest.mark.parametrize("response, label, accuracy, is_marked", [
    ("so the answer is \\boxed{40}.", "40", 1, True),                       # boxed
    ("\\boxed{41} no wait \\boxed{40}", "40", 1, True),                      # the last box counts
    ("\\boxed{\\frac{1}{2}}", "0.5", 1, True),                               # fraction = decimal
    ("\\boxed{0.50}", "1/2", 1, True),
    ("$\\boxed{\\dfrac{3}{4}}$", "\\frac{3}{4}", 1, True),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1, True),                           # symbolic equality
    ("\\boxed{{40}}", "40", 1, True),                                        # nested braces
    ("7*4=28, 28+12=40 <answer>40</answer>", "40", 1, True),                 # tagged
    ("<answer> -12 </answer>", "-12", 1, True),                              # negative numbers
    ("7*4=28, 28+12=40\n#### 40", GSM8K_LABEL, 1, True),                     # GSM8K style, both sides
    ("#### 1,234", "1234", 1, True),                                         # thousands commas
    ("I think it is 40.", GSM8K_LABEL, 1, False),                            # last number, unmarked
    ("first 3, then -7", "-7", 1, False),
    ("\\boxed{39}", GSM8K_LABEL, 0, True),                                   # wrong
    ("\\boxed{40} but <answer>39</answer>", "39", 0, True),                  # boxed wins over the tag
    ("no answer here", "40", 0, False),                                      # nothing to extract
    ("<answer></answer>", "40", 0, False),
    ("\x00\x01 }{ \\boxed{ ]][[ %%", "40", 0, False),                        # garbage
    ("\\boxed{40", "40", 1, False),                                          # unclosed box: last number
    ("#### 0.33", "\\frac{1}{3}", 0, True),                                  # values compare exactly:
    ("\\boxed{0.3333333}", "\\frac{1}{3}", 0, True),                         # a near miss is a miss
    ("\\boxed{1.41421356}", "\\sqrt{2}", 0, True),
    ("\\boxed{0.25}", "\\frac{1}{4}", 1, True),                              # an exact decimal is a hit
    ("#### 2", "\\sqrt{4}", 1, True),
])
def test_math_reward_table(response, label, accuracy, is_marked):
    out = reward(response, label)
    assert out == {"reward": float(accuracy), "accuracy": float(accuracy), "format": float(is_marked)}


def test_math_reward_preference_order():
    assert extract_answer("\\boxed{1} <answer>2</answer>\n#### 3 and 4") == ("1", True)
    assert extract_answer("<answer>2</answer>\n#### 3 and 4") == ("2", True)
    assert extract_answer("#### 3\nthen 4") == ("3", True)
    assert extract_answer("3 then 4") == ("4", False)
    assert extract_answer("none") == (None, False)


@pytest.mark.parametrize("response", ["x" * 1_000_000 + " 40", "7" * 1_000_000, "\\boxed{" * 200_000,
                                      ("{" * 1000 + "\\boxed{") * 500])
def test_a_megabyte_response_is_scored_in_bounded_time(response):
    started = time.perf_counter()
    out = reward(response, "40")
    assert time.perf_counter() - started < 2.0, "scans must stay linear in the response"
    assert set(out) == {"reward", "format", "accuracy"}


def only_reward(response: str, label: str) -> dict:
    """A reward function with no parts: 1 for a response that is exactly the label."""
    return {"reward": float(response.strip() == label)}


def short(response: str, label: str) -> dict:
    return {"reward": -len(response) / 100}


def test_weighted_reward_functions_sum_and_log_each_ones_parts():
    fn = load_reward(RewardConfig(fns=["nano_miles.rewards.math:reward", "tests.test_rewards:short"],
                                  weights=[1.0, 0.5]))
    out = fn("\\boxed{40}", "40")
    assert out["reward"] == pytest.approx(1.0 - 0.5 * 10 / 100)
    assert out["math/accuracy"] == out["accuracy"] == 1.0 and out["math/format"] == out["format"] == 1.0
    assert out["math/reward"] == 1.0 and out["short/reward"] == pytest.approx(-0.1)
    assert load_reward(RewardConfig(fn="tests.test_rewards:only_reward"))("4", "4") == {"reward": 1.0}


def test_a_reward_function_without_accuracy_works_through_scoring_records_and_summary():
    worker = RewardWorker(only_reward, timeout_s=5.0)
    try:
        samples = [Sample(np.array(ids, np.int32), np.zeros(len(ids), np.float32), np.zeros(len(ids), np.int32),
                          "stop") for ids in ([1], [2], [1])]
        group = RolloutGroup("e0-i0", 0, np.array([5, 6], np.int32), samples, metadata={"label": "1"})
        scored = score_group(group, worker, lambda ids: str(int(ids[0])))
    finally:
        worker.stop()
    assert scored.rewards.tolist() == [1.0, 0.0, 1.0] and scored.reward_parts == {}

    learned = LearnResult(pg_loss=0.5, means=LossDiagnostics(clip_fraction=0.0, dual_clip_fraction=0.0, parity=0.0,
                                                             entropy=0.5), num_tokens=3, grad_norm=1.0, lr=1e-4)
    stats = StepStats.from_groups([scored], step=1, learned=learned, advantages=np.array([0.7, -1.4, 0.7]))
    assert stats.accuracy is None and stats.format is None and stats.reward == pytest.approx(2 / 3)
    record = {**stats.as_dict(), "step": 1, "update_ms": 1.0, "queue_depth": 0, "step_s": 0.1,
              "eval_reward": 0.25}
    line = format_step_line(record, 10)
    assert "acc" not in line and "format" not in line and "held-out reward 0.250" in line
    summary = summarize([record], [{"step": step, "accuracy": None, "elapsed_s": float(step), "reward": reward,
                                    "pass_at_k": None, "k": 1, "parts": {}} for step, reward in ((0, 0.25), (1, 0.75))])
    assert summary["eval_accuracy_start"] is None and summary["eval_accuracy_delta"] is None
    assert (summary["eval_reward_start"], summary["eval_reward_max"]) == (0.25, 0.75)


def ramp(num_tokens: int, max_new: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment, written out case by case."""
    if num_tokens <= max_new - buffer:
        return 0.0
    return -penalty * (num_tokens - (max_new - buffer)) / buffer


def test_the_overlong_penalty_ramps_over_the_last_tokens_of_the_budget():
    from nano_miles.rewards.overlong import reward as overlong
    for n, want in ((1, 0.0), (32, 0.0), (33, -0.0625), (40, -0.5), (47, -0.9375), (48, -1.0)):
        got = overlong("text", "label", num_response_tokens=n, max_new_tokens=48, overlong_buffer=16,
                       overlong_penalty=1.0)["reward"]
        assert got == pytest.approx(want) == pytest.approx(ramp(n, 48, 16, 1.0)), n
    assert overlong("", "", num_response_tokens=10, max_new_tokens=10, overlong_buffer=10,
                    overlong_penalty=0.5) == {"reward": -0.5}


def length_only(response: str, label: str, *, num_response_tokens: int, finish_reason: str) -> dict:
    return {"reward": float(num_response_tokens), "cut": float(finish_reason == "length")}


def needs_a_stranger(response: str, label: str, *, temperature: float) -> dict:
    return {"reward": temperature}


def test_a_reward_stage_sums_the_task_reward_and_the_overlong_penalty_with_the_samples_facts():
    cfg = load_config(overrides=['--reward.fns=["nano_miles.tasks.arithmetic:reward", '
                                 '"nano_miles.rewards.overlong:reward", "tests.test_rewards:length_only"]',
                                 "--reward.weights=[1, 1, 0]", "--rollout.max_new_tokens=10",
                                 "--reward.overlong_buffer=4", "--reward.overlong_penalty=0.5"])
    worker = RewardWorker(load_reward(cfg.reward), timeout_s=5.0)
    try:
        texts = ["<answer>7</answer>", "<answer>7</answer>", "<answer>8</answer>"]
        lengths, reasons = [3, 9, 10], ["stop", "stop", "length"]
        samples = [Sample(np.arange(n, dtype=np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32), why)
                   for n, why in zip(lengths, reasons)]
        group = RolloutGroup("e0-i0", 0, np.array([5, 6], np.int32), samples, metadata={"label": "7"})
        decoded = {n: t for n, t in zip(lengths, texts)}
        scored = score_group(group, worker, lambda ids: decoded[len(ids)],
                             facts=lambda _, s: sample_facts(cfg, len(s.response_tokens), s.finish_reason))
    finally:
        worker.stop()
    from nano_miles.tasks.arithmetic import reward as arithmetic
    task = [arithmetic(t, "7")["reward"] for t in texts]
    penalties = [ramp(n, 10, 4, 0.5) for n in lengths]
    assert penalties == [0.0, -0.375, -0.5]
    assert scored.rewards.tolist() == pytest.approx([t + p for t, p in zip(task, penalties)])
    assert scored.reward_parts["overlong/reward"].tolist() == pytest.approx(penalties)
    assert scored.reward_parts["length_only/cut"].tolist() == [0.0, 0.0, 1.0]


def test_a_reward_function_that_asks_for_an_unknown_keyword_is_refused_at_load():
    with pytest.raises(UserError, match=r"^reward.fn: keyword parameter 'temperature' is not one a reward "
                                        r"function can be given \(one of num_response_tokens, finish_reason"):
        load_reward(RewardConfig(fn="tests.test_rewards:needs_a_stranger"))


def record_reward(prompt, response, label, *, difficulty, turns):
    """The (prompt, response, label, **fields) form, naming what it wants; returns a float."""
    return float(response == label) + 0.1 * difficulty + 0.01 * len(turns) + 0.001 * len(prompt)


def everything_reward(prompt, response, label, **fields):
    """The same form taking every field: the parts say what it was given."""
    return {"reward": 1.0, "num_turns": len(fields["turns"]), "has_source": float(fields["source"] == "mine"),
            "finish_is_stop": float(fields["finish_reason"] == "stop")}


def test_a_reward_function_may_take_the_record_and_the_turns_and_return_a_float(tmp_path):
    """Chosen by the signature: the record's fields (from a data file's other keys), the prompt as the
    task gives it and the trajectory's turns reach the function through the real reward stage."""
    from nano_miles.stages.reward.scorer import RewardStage
    from nano_miles.tasks.files import read_problems
    import json
    import zmq

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "What is 2+3?", "answer": "5", "difficulty": 2, "source": "mine"}) + "\n")
    problems = read_problems(data, ("question", "answer"), "train")
    assert problems[0].fields == {"difficulty": 2, "source": "mine"}
    decode = {5: "5", 6: "<tool_call>2+3</tool_call>", 7: "tool: 5"}.__getitem__
    text = lambda ids: "".join(decode(int(i)) for i in ids)  # noqa: E731
    two_turns = Sample(np.array([6, 7, 5], np.int32), np.array([-1, 0, -1], np.float32), np.array([0, -1, 0], np.int32),
                       "stop", np.array([1, 0, 1], np.uint8))
    one_turn = Sample(np.array([5], np.int32), np.array([-1], np.float32), np.array([0], np.int32), "length")
    group = RolloutGroup("e0-i0", 0, np.array([9], np.int32), [two_turns, one_turn], metadata={"label": "5", "index": 0})
    results = {}
    for name, fn in (("record", record_reward), ("everything", everything_reward)):
        cfg = load_config(overrides=[f"--reward.endpoint=ipc://{tmp_path}/r-{name}", f"--trainer.endpoint=ipc://{tmp_path}/t",
                                     "--reward.metrics_port=0"])
        ctx = zmq.Context()
        stage = RewardStage(cfg, ctx, load_reward(RewardConfig(fn=f"tests.test_rewards:{name}_reward")), text, problems)
        try:
            results[name] = score_group(group, stage.worker, text, facts=stage.facts)
        finally:
            stage.close()
            stage.pull.close(linger=0)
            stage.push.close(linger=0)
            ctx.term()
    # the response is the model's last turn: "5" for both samples; three turns, then one
    assert results["record"].rewards.tolist() == pytest.approx([1 + 0.2 + 0.03 + 0.012, 1 + 0.2 + 0.01 + 0.012])
    parts = {k: v.tolist() for k, v in results["everything"].reward_parts.items()}
    assert parts == {"num_turns": [3.0, 1.0], "has_source": [1.0, 1.0], "finish_is_stop": [1.0, 0.0]}


def slow_verifier(response: str, label: str) -> dict[str, float]:
    """A verifier that takes its time (code execution, say), and dies on "exit"."""
    if response == "exit":
        os._exit(3)
    time.sleep(0.3)
    return {"reward": float(response == label)}


def test_a_groups_samples_are_scored_in_parallel_and_a_dying_worker_costs_one_sample():
    samples = [Sample(np.array([t], np.int32), np.zeros(1, np.float32), np.zeros(1, np.int32), "stop")
               for t in (1, 1, 2, 1, 1, 1, 1, 1)]
    group = RolloutGroup("e0-i0", 0, np.array([9], np.int32), samples, metadata={"label": "yes"})
    decode = {1: "yes", 2: "exit"}.__getitem__
    elapsed, scored = {}, {}
    for num_workers in (1, 4):
        worker = RewardWorker(slow_verifier, timeout_s=5.0, num_workers=num_workers)
        worker.start()
        failed = []
        try:
            started = time.perf_counter()
            scored[num_workers] = score_group(group, worker, lambda ids: decode(int(ids[0])),
                                              on_failure=lambda i, f: failed.append((i, f.reason)))
            elapsed[num_workers] = time.perf_counter() - started
        finally:
            worker.stop()
        assert failed == [(2, "reward_error")] and worker.num_restarts == 1
        assert scored[num_workers].rewards.tolist() == [1, 1, 0, 1, 1, 1, 1, 1]
    assert elapsed[1] > 7 * 0.3 and elapsed[4] < elapsed[1] / 2, elapsed
