"""Held-out accuracy over wall time for the default synchronous run, under the real supervisord.

Run: python bench/learning.py [--seeds 0,1,2] [--word-problems] [--config FILE] [--out DIR]
                               [--target-points 25] [--target-s 300] [--section.key=value ...]
On a GPU (the large policy taught the word format, configs/gpu_word_problems.toml says how):
     python bench/learning.py --word-problems --config configs/gpu_word_problems.toml --seeds 0
         --out bench/results/gpu --target-points 30 --target-s 600

Starts the pipeline exactly as `make run` does (configs/default.toml plus the given overrides) in a
private run directory, once per seed (`run.seed`; seed 0 is `make run`'s own run), follows the
trainer's progress, then prints accuracy at each evaluation with the wall time it took to get there,
and writes bench/results/learning.json and learning.png: the figures the README quotes for `make run`
(the seed-0 run's at the top level, every seed's curve under "seeds"). With `--word-problems` the run
is the README's own-data example instead (examples/word_problems/ through the chat template, the
math reward), written to learning_word_problems.json and .png. --config FILE reaches every stage
through $NANOMILES_CONFIG; --out DIR is where the files go (default bench/results).
Target on a 2-core CPU machine: +25 points of held-out accuracy within 5 minutes of wall time (start-up
included), as the mean over the seeds (200 held-out problems make one run's accuracy +-3 points
noisy); --target-points and --target-s set another. The verdict ("met" or "missed by X points") is
printed and kept in the JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.learning_runs import WORD_PROBLEMS  # noqa: E402
from nano_miles.run.cli import ArgumentParser, run  # noqa: E402
from harness.verdict import Verdict, print_verdicts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_POINTS, TARGET_S = 25.0, 300.0


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


def plot(runs: list[dict], out: Path, title: str, target_points: float, target_s: float) -> bool:
    from nano_miles.observe.plots import pyplot_or_none
    plt = pyplot_or_none()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in runs:
        ax.plot([e[2] / 60 for e in run["evals"]], [100 * e[1] for e in run["evals"]], marker="o",
                label=f"seed {run['seed']}")
    start = sum(run["evals"][0][1] for run in runs) / len(runs)
    ax.axhline(100 * start + target_points, ls="--", c="gray", label=f"mean start + {target_points:.0f} points")
    ax.axvline(target_s / 60, ls=":", c="gray")
    ax.set_xlabel("wall time since training started (min)")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return True


def run_once(argv: list[str]) -> dict | None:
    """One supervised run with `argv` overrides; its summary, with the wall time, or None if it failed."""
    from harness.supervised_run import SupervisedRun
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
            return None
        return {**json.loads(summary_path.read_text()), "wall_s": wall_s}


def gain_within_target(evals: list, target_s: float) -> float:
    """Best held-out accuracy within `target_s` of wall time, minus the start, in points."""
    return 100 * (max(acc for _, acc, t in evals if t <= target_s) - evals[0][1])


def seed_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a comma-separated list of integers, not {text!r}") from None


def main(argv: list[str]) -> int:
    from nano_miles.run.config import ConfigError, is_override, load_config
    parser = ArgumentParser(prog="python bench/learning.py", description=__doc__)
    parser.add_argument("--seeds", type=seed_list, default=[0, 1, 2], help="run.seed of each run, e.g. 0,1,2")
    parser.add_argument("--word-problems", action="store_true", help="the own-data example instead")
    parser.add_argument("--config", type=lambda v: str(Path(v).resolve()), default=None,
                        help="the TOML file every stage reads (default configs/default.toml)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON and PNG go")
    parser.add_argument("--target-points", type=float, default=TARGET_POINTS, help="held-out gain to reach")
    parser.add_argument("--target-s", type=float, default=TARGET_S, help="... within this much wall time")
    args = parser.parse_args([a for a in argv if not is_override(a)])
    seeds, out_dir, target_points, target_s = args.seeds, args.out, args.target_points, args.target_s
    argv = [a for a in argv if is_override(a)]
    if args.config is not None:  # every stage reads the same file
        os.environ["NANOMILES_CONFIG"] = args.config
    where = "2 CPU cores" if args.config is None else Path(args.config).name
    name, title = "learning", f"sync GRPO, small policy, {where}"
    if args.word_problems:
        argv = ([] if args.config else WORD_PROBLEMS) + argv
        name, title = "learning_word_problems", f"sync GRPO, word problems (JSONL, chat template), {where}"
    try:
        cfg = load_config(overrides=argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    runs = []
    for seed in seeds:
        print(f"\n=== seed {seed} ({len(runs) + 1} of {len(seeds)}) ===", flush=True)
        summary = run_once(argv + [f"--run.seed={seed}"])
        if summary is None:
            return 1
        evals = [e[:3] for e in summary["evals"]]  # [step, held-out accuracy, elapsed s]
        runs.append({"seed": seed, "summary": summary, "evals": evals, "gain": gain_within_target(evals, target_s)})
    print(f"\n{'seed':>4} {'step':>6} {'wall s':>8} {'held-out %':>11} {'gain':>7}")
    for run in runs:
        start = run["evals"][0][1]
        for step, acc, elapsed in run["evals"]:
            print(f"{run['seed']:>4} {step:>6} {elapsed:>8.0f} {100 * acc:>11.1f} {100 * (acc - start):>+7.1f}")
    gains = [run["gain"] for run in runs]
    mean_gain = sum(gains) / len(gains)
    print(f"\nbest gain within {target_s / 60:.0f} min per seed: " + ", ".join(f"{g:+.1f}" for g in gains)
          + f" points; mean {mean_gain:+.1f}")
    verdict = Verdict(f"held-out gain within {target_s / 60:.0f} min, mean of {len(runs)} seeds", mean_gain, ">=",
                      target_points, "points")
    print_verdicts([verdict])
    first = runs[0]["summary"]  # the top level is seed 0's run: `make run`'s own, as the README quotes it
    print(f"seed {runs[0]['seed']}: {first['num_steps']} steps in {first['wall_s'] / 60:.1f} min (start-up and "
          f"evaluations included); held-out {100 * runs[0]['evals'][0][1]:.1f} % -> max "
          f"{100 * first['eval_accuracy_max']:.1f} %, end {100 * first['eval_accuracy_end']:.1f} %")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"config": cfg.to_dict(), "seed": runs[0]["seed"], "num_steps": first["num_steps"],
              "wall_s": first["wall_s"], "eval_accuracy_start": runs[0]["evals"][0][1],
              "eval_accuracy_max": first["eval_accuracy_max"], "eval_accuracy_end": first["eval_accuracy_end"],
              "ledger": first["ledger"], "evals": runs[0]["evals"], "mean_step_s": first["mean_step_s"],
              "mean_update_ms": first["mean_update_ms"], "target_points": target_points, "target_s": target_s,
              "mean_gain_points_within_target": mean_gain,
              "seeds": [{"seed": r["seed"], "evals": r["evals"], "gain_points_within_target": r["gain"],
                         "wall_s": r["summary"]["wall_s"], "eval_accuracy_max": r["summary"]["eval_accuracy_max"]}
                        for r in runs],
              "verdicts": [verdict.to_json()]}
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2))
    if plot(runs, out_dir / f"{name}.png", title, target_points, target_s):
        print(f"wrote {out_dir / name}.json and {name}.png")
    return 0


if __name__ == "__main__":
    run(main, "learning")
