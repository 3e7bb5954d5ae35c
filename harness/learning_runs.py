"""The pipeline runs whose learning the tests assert, the margins they assert, and how a bench runs one.

The margins come from repeated seeds, not from one lucky run: `python bench/learning_seeds.py` runs
each config below with seeds 0-4 and writes bench/results/learning_seeds.json; a test asserts half
the smallest gain any seed showed, so it fails only when learning really got weaker. `run_once` is
how the learning benches (`bench/learning.py`, `bench/algorithms.py`) run a pipeline to its summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results" / "learning_seeds.json"

# tests/test_pipeline.py: small enough for 2 CPU cores, long enough for several evaluations
SYNC = ["--trainer.num_steps=48", "--trainer.batch_groups=16", "--rollout.group_size=8",
        "--trainer.eval_every=16", "--task.num_test=200", "--trainer.checkpoint_every=24"]
# tests/test_async.py: the producer runs up to 2 versions ahead
ASYNC = ["--run.mode=async", "--run.max_staleness=2", "--trainer.num_steps=40", "--trainer.batch_groups=8",
         "--rollout.group_size=8", "--trainer.eval_every=20", "--task.num_test=200", "--trainer.lr=1e-4"]
# tests/test_lora.py: sync with LoRA adapters of rank 16 (and the larger learning rate adapters take)
LORA = ["--trainer.lora_rank=16", "--trainer.lora_alpha=32", "--trainer.lr=1e-3", "--trainer.num_steps=32",
        "--trainer.batch_groups=16", "--rollout.group_size=8", "--trainer.eval_every=16", "--task.num_test=200",
        "--trainer.checkpoint_every=16"]
CONFIGS = {"sync": SYNC, "async": ASYNC, "lora": LORA}
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


def follow(run, timeout_s: float) -> None:
    """Print the trainer's step lines, warnings and errors as they come, until the run ends."""
    log_path, offset = run.run_dir / "trainer.log", 0
    deadline = time.monotonic() + timeout_s
    while True:
        has_ended = run.proc.poll() is not None  # then one last read: the final step's line comes just before the end
        if not has_ended and time.monotonic() > deadline:
            run.stop()
            raise SystemExit(f"run did not finish in {timeout_s:.0f}s; logs in {run.run_dir}")
        if log_path.exists():
            with log_path.open("rb") as f:  # only what was appended since the last look
                f.seek(offset)
                new = f.read()
            complete = new[:new.rfind(b"\n") + 1]
            offset += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                if any(mark in line for mark in (" step ", "held-out", " WARNING ", " ERROR ")):
                    print(line, flush=True)
        if has_ended:
            return
        time.sleep(1.0)


def run_once(run_dir: Path, argv: list[str], is_followed: bool) -> dict | None:
    """One supervised run in `run_dir` with `argv` overrides; its summary, with the wall time, or None
    if it failed. A run directory that holds a finished run is read, not run again."""
    from harness.supervised_run import SupervisedRun
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        return json.loads(summary_path.read_text())
    started = time.monotonic()
    run = SupervisedRun(run_dir, argv).start()
    try:
        if is_followed:
            follow(run, timeout_s=3 * 3600)
        else:
            run.wait(timeout_s=3 * 3600)
    finally:
        run.stop()
    if not summary_path.exists():
        print(f"the run in {run_dir} failed:\n{run.tail()}", file=sys.stderr)
        return None
    # what a user of `make run` waits for, start-up included; kept with the run for a later read
    summary = {**json.loads(summary_path.read_text()), "wall_s": time.monotonic() - started}
    summary_path.write_text(json.dumps(summary, indent=2))
    return summary


def seed_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a comma-separated list of integers, not {text!r}") from None


def add_study_arguments(parser, variants, out: Path, name_default: str | None, name_help: str) -> None:
    """The options a learning study takes (`bench/learning.py`, `bench/algorithms.py`): which variants and
    seeds, the config every stage reads, where the results and the run directories go, pipelines at once."""
    def variant_list(text: str) -> list[str]:
        names = text.split(",")
        if not set(names) <= set(variants):
            raise argparse.ArgumentTypeError(f"takes variants of {', '.join(variants)}, comma-separated, not {text!r}")
        return names
    parser.add_argument("--variants", type=variant_list, default=list(variants), help="which runs, comma-separated")
    parser.add_argument("--seeds", type=seed_list, default=[0, 1, 2], help="run.seed of each run, e.g. 0,1,2")
    parser.add_argument("--config", type=lambda v: str(Path(v).resolve()), default=None,
                        help="the TOML file every stage reads (default configs/default.toml)")
    parser.add_argument("--out", type=Path, default=out, help="where the JSON and PNG go")
    parser.add_argument("--name", default=name_default, help=name_help)
    parser.add_argument("--jobs", type=int, default=1, help="pipelines run at once")
    parser.add_argument("--keep-runs", type=Path, default=None, help="keep the run directories here (and reuse "
                                                                      "finished ones)")
