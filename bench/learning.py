"""Held-out accuracy over wall time for the default synchronous run, under the real supervisord.

Run: python bench/learning.py [--word-problems] [--section.key=value ...]   (e.g. --trainer.num_steps=100)

Starts the pipeline exactly as `make run` does (configs/default.toml plus the given overrides) in a
private run directory, follows the trainer's progress, then prints accuracy at each evaluation with
the wall time it took to get there, and writes bench/results/learning.json and learning.png: the
figures the README quotes for `make run` (same config, same seed, so the same run). With
`--word-problems` the run is the README's own-data example instead (examples/word_problems/ through
the chat template, the math reward), written to learning_word_problems.json and .png.
Target on a 2-core CPU machine: +30 points of held-out accuracy within 10 minutes; the verdict ("met"
or "missed by X points") is printed and kept in learning.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.learning_runs import WORD_PROBLEMS  # noqa: E402
from harness.verdict import Verdict, print_verdicts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_POINTS, TARGET_S = 30.0, 600.0


def follow(run, timeout_s: float) -> None:
    """Print the trainer's step lines as they come, until the run ends."""
    log_path, offset = run.run_dir / "trainer.log", 0
    deadline = time.monotonic() + timeout_s
    while run.proc.poll() is None:
        if time.monotonic() > deadline:
            run.stop()
            raise SystemExit(f"run did not finish in {timeout_s:.0f}s; logs in {run.run_dir}")
        if log_path.exists():
            with log_path.open("rb") as f:  # only what was appended since the last look
                f.seek(offset)
                new = f.read()
            complete = new[:new.rfind(b"\n") + 1]
            offset += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                if " step " in line or "held-out" in line:
                    print(line, flush=True)
        time.sleep(1.0)


def plot(evals: list, out: Path, title: str) -> bool:
    from nano_miles.observe.plots import pyplot_or_none
    plt = pyplot_or_none()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([e[2] / 60 for e in evals], [100 * e[1] for e in evals], marker="o")
    ax.axhline(100 * evals[0][1] + TARGET_POINTS, ls="--", c="gray", label=f"start + {TARGET_POINTS:.0f} points")
    ax.axvline(TARGET_S / 60, ls=":", c="gray")
    ax.set_xlabel("wall time since training started (min)")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return True


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    from harness.supervised_run import SupervisedRun
    from nano_miles.run.config import ConfigError, load_config
    name, title = "learning", "sync GRPO, small policy, 2 CPU cores"
    if "--word-problems" in argv:
        argv = WORD_PROBLEMS + [a for a in argv if a != "--word-problems"]
        name, title = "learning_word_problems", "sync GRPO, word problems (JSONL, chat template), 2 CPU cores"
    try:
        cfg = load_config(overrides=argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        run = SupervisedRun(Path(tmp) / "run", argv).start()
        try:
            follow(run, timeout_s=3 * 3600)
        finally:
            run.stop()
        wall_s = time.monotonic() - started  # what a user of `make run` waits for, start-up included
        summary_path = run.run_dir / "summary.json"
        if not summary_path.exists():
            print(f"the run failed:\n{run.tail()}", file=sys.stderr)
            return 1
        summary = json.loads(summary_path.read_text())
    evals = [e[:3] for e in summary["evals"]]  # [step, held-out accuracy, elapsed s]
    start = evals[0][1]
    print(f"\n{'step':>6} {'wall s':>8} {'held-out %':>11} {'gain':>7}")
    for step, acc, elapsed in evals:
        print(f"{step:>6} {elapsed:>8.0f} {100 * acc:>11.1f} {100 * (acc - start):>+7.1f}")
    within = [acc for _, acc, t in evals if t <= TARGET_S]
    gain = 100 * (max(within) - start)
    reached = next((t for _, acc, t in evals if 100 * (acc - start) >= TARGET_POINTS), None)
    print(f"\nbest gain within {TARGET_S / 60:.0f} min: {gain:+.1f} points; "
          + (f"+{TARGET_POINTS:.0f} reached after {reached:.0f}s" if reached else f"+{TARGET_POINTS:.0f} not reached"))
    verdict = Verdict(f"held-out gain within {TARGET_S / 60:.0f} min", gain, ">=", TARGET_POINTS, "points")
    print_verdicts([verdict])
    RESULTS.mkdir(exist_ok=True)
    print(f"{summary['num_steps']} steps in {wall_s / 60:.1f} min (start-up and evaluations included); held-out "
          f"{100 * start:.1f} % -> max {100 * summary['eval_accuracy_max']:.1f} %, end "
          f"{100 * summary['eval_accuracy_end']:.1f} %")
    result = {"config": cfg.to_dict(), "num_steps": summary["num_steps"], "wall_s": wall_s,
              "eval_accuracy_start": start, "eval_accuracy_max": summary["eval_accuracy_max"],
              "eval_accuracy_end": summary["eval_accuracy_end"], "ledger": summary["ledger"],
              "evals": evals, "gain_points_within_target": gain,
              "seconds_to_target": reached, "mean_step_s": summary["mean_step_s"],
              "mean_update_ms": summary["mean_update_ms"], "verdicts": [verdict.to_json()]}
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    if plot(evals, RESULTS / f"{name}.png", title):
        print(f"wrote {RESULTS / name}.json and {name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
