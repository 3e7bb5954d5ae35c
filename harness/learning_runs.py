"""The pipeline runs whose learning the tests assert, and the margins they assert.

The margins come from repeated seeds, not from one lucky run: `python bench/learning_seeds.py` runs
each config below with seeds 0-4 and writes bench/results/learning_seeds.json; a test asserts half
the smallest gain any seed showed, so it fails only when learning really got weaker.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results" / "learning_seeds.json"

# tests/test_pipeline.py: small enough for 2 CPU cores, long enough for several evaluations
SYNC = ["--trainer.num_steps=48", "--trainer.batch_groups=16", "--rollout.group_size=8",
        "--trainer.eval_every=16", "--task.num_test=200", "--trainer.checkpoint_every=24"]
# tests/test_async.py: the producer runs up to 2 versions ahead
ASYNC = ["--run.mode=async", "--run.max_staleness=2", "--trainer.num_steps=40", "--trainer.batch_groups=8",
         "--rollout.group_size=8", "--trainer.eval_every=20", "--task.num_test=200", "--trainer.lr=1e-4"]
CONFIGS = {"sync": SYNC, "async": ASYNC}
# README "Train on your own data", without a GPU: the project's word problems as a user's JSONL file
WORD_PROBLEMS = ["--task.name=nano_miles.tasks.files", "--task.train_file=examples/word_problems/train.jsonl",
                 "--task.test_file=examples/word_problems/test.jsonl", "--task.prompt_key=question",
                 "--task.label_key=answer", "--task.chat_template=true", "--reward.fn=nano_miles.rewards.math:reward"]
GAINS = ("eval_gain", "reward_gain")  # held-out max - start; late - early training reward


def gains(summary: dict) -> dict[str, float]:
    return {"eval_gain": summary["eval_accuracy_max"] - summary["eval_accuracy_start"],
            "reward_gain": summary["reward_late"] - summary["reward_early"]}


def margin(config: str, gain: str) -> float:
    """Half the smallest `gain` of `config` over the recorded seeds; an error if any seed did not gain."""
    result = json.loads(RESULTS.read_text())
    if result.get("complete") is False:  # the bench was cut short: its margins would rest on fewer seeds
        raise AssertionError(f"{RESULTS.name} holds an unfinished bench's runs; run it to its end")
    runs = result["configs"][config]["runs"]
    smallest = min(run[gain] for run in runs)
    if smallest <= 0:
        raise AssertionError(f"{RESULTS.name}: a {config} run with seed {min(runs, key=lambda r: r[gain])['seed']} "
                             f"had {gain} {smallest:+.3f}; nothing to assert a margin on")
    return smallest / 2
