"""Sync vs fully-async GRPO at several staleness bounds, same seeds and sample budget, side by side.

Run: python bench/staleness.py [--staleness=0,1,2,4] [--seeds=0,1,2] [--target-accuracy=+4] [--out=DIR]
     [--config FILE] [--section.key=value ...]
     [--keep-runs=DIR: keep the run directories] [--from-runs=DIR: only re-read kept ones]
On a GPU: python bench/staleness.py --staleness=2 --target-accuracy=0.9 --config configs/gpu.toml
          --out=bench/results/gpu

Each variant (sync, then async with max_staleness S for each S) is a full pipeline run under the real
supervisord, once per seed (`--run.seed=N`). Each run's clock starts with its first step (start-up is
left out). Reported per run: training wall time, samples/s, trainer and engine idle fractions,
staleness histogram, goodput, reward early/late, held-out accuracy, and the time it took to reach a
fixed held-out accuracy target, the same for every run: `--target-accuracy=A` is absolute (0.30),
`--target-accuracy=+N` is N points above the sync runs' mean start accuracy (default +4: on the CPU
defaults the sync run goes from 23 % to 28 % in its 80 steps). Per variant: the mean and [min, max]
over seeds of final and max held-out accuracy and of the time to the target.

Targets, one verdict each, on the means over seeds: async S = 2 reaches the accuracy target within
0.8x the sync runs' time, and its goodput is >= 0.95. Prints the tables and the verdicts; writes
staleness.json (every run, the per-variant statistics, the verdicts) and staleness.png into --out
(default bench/results). --config FILE reaches every stage through $NANOMILES_CONFIG.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.verdict import Spread, Verdict, print_verdicts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULTS = ["--trainer.num_steps=80", "--trainer.batch_groups=8", "--rollout.group_size=8",
            "--trainer.eval_every=10", "--task.num_test=200", "--trainer.checkpoint_every=0"]
DEFAULT_TARGET_ACCURACY = "+4"
TARGET_STALENESS = 2        # the variant the targets are set for
TARGET_TIME_RATIO = 0.8     # its time to the accuracy target, over the sync runs' (means over seeds)
TARGET_GOODPUT = 0.95


def run_variant(name: str, seed: int, overrides: list[str], root: Path) -> dict:
    from harness.supervised_run import SupervisedRun
    print(f"running {name}, seed {seed} ...", flush=True)
    run = SupervisedRun(root / run_dir_name(name, seed), overrides + [f"--run.seed={seed}"]).start()
    try:
        if run.wait(timeout_s=3600) != 0 or not (run.run_dir / "summary.json").exists():
            raise SystemExit(f"{name} (seed {seed}) failed:\n{run.tail()}")
    finally:
        run.stop()
    return read_run(name, seed, run.run_dir)


def slug(name: str) -> str:
    return name.replace(" ", "_").replace("=", "")


def run_dir_name(name: str, seed: int) -> str:
    return f"{slug(name)}_seed{seed}"


def read_run(name: str, seed: int, run_dir: Path) -> dict:
    """One run's row. Its clock starts when step 1 starts: what comes before (engine start-up, the
    first evaluation, which on a fresh GPU host includes compiling kernels) is not training speed."""
    from nano_miles.observe.run_record import read_jsonl
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_jsonl(run_dir / "metrics.jsonl")
    t0 = records[0]["elapsed_s"] - records[0]["step_s"]
    train_s = records[-1]["elapsed_s"] - t0
    summary["evals"] = [[e[0], e[1], max(0.0, e[2] - t0)] for e in summary["evals"]]  # [step, accuracy, s]
    return {"name": name, "seed": seed, "summary": summary, "train_s": train_s, "startup_s": t0,
            "samples_per_s": sum(r["num_samples"] for r in records) / train_s,
            "curve": [[r["elapsed_s"] - t0, r["reward"]] for r in records]}


def time_to_reach(evals: list, accuracy: float) -> float | None:
    """Seconds until the first evaluation at or above `accuracy`; None if none was."""
    return next((e[2] for e in evals if e[1] >= accuracy - 1e-9), None)


def resolve_target_accuracy(spec: str, start_accuracies: list[float]) -> float:
    """`+N`: N points above the mean start accuracy; otherwise an absolute accuracy in (0, 1]."""
    if spec.startswith("+"):
        return sum(start_accuracies) / len(start_accuracies) + float(spec[1:]) / 100
    accuracy = float(spec)
    if not 0 < accuracy <= 1:
        raise ValueError(f"--target-accuracy must be in (0, 1] or +POINTS, not {spec!r}")
    return accuracy


def aggregate(rows: list[dict], target_accuracy: float) -> list[dict]:
    """Per variant, in the order first seen: mean and spread over its seeds of what the verdicts use."""
    names = list(dict.fromkeys(r["name"] for r in rows))
    variants = []
    for name in names:
        runs = [r for r in rows if r["name"] == name]
        variants.append({
            "name": name, "seeds": [r["seed"] for r in runs],
            "accuracy_end": Spread.of([r["summary"]["eval_accuracy_end"] for r in runs]).to_json(),
            "accuracy_max": Spread.of([r["summary"]["eval_accuracy_max"] for r in runs]).to_json(),
            "seconds_to_target": Spread.of([time_to_reach(r["summary"]["evals"], target_accuracy)
                                            for r in runs]).to_json(),
            "train_s": Spread.of([r["train_s"] for r in runs]).to_json(),
            "samples_per_s": Spread.of([r["samples_per_s"] for r in runs]).to_json(),
            "goodput": Spread.of([r["summary"]["goodput"] for r in runs]).to_json()})
    return variants


def verdicts(variants: list[dict]) -> list[Verdict]:
    """One verdict per target, on the means over seeds; none when the S = 2 variant was not run."""
    by_name = {v["name"]: v for v in variants}
    target = by_name.get(f"async S={TARGET_STALENESS}")
    if target is None or "sync" not in by_name:
        return []
    sync_s, async_s = by_name["sync"]["seconds_to_target"]["mean"], target["seconds_to_target"]["mean"]
    ratio = None if sync_s is None or async_s is None or sync_s <= 0 else async_s / sync_s
    why = "the sync runs did not all reach the target" if sync_s is None else "not reached by every seed"
    return [Verdict(f"S={TARGET_STALENESS} time to the accuracy target, over sync's", ratio, "<=",
                    TARGET_TIME_RATIO, "x", 2, why_none=why),
            Verdict(f"S={TARGET_STALENESS} goodput", target["goodput"]["mean"], ">=", TARGET_GOODPUT, "", 3)]


def print_runs(rows: list[dict], target_accuracy: float) -> None:
    print(f"\n{'run':<11} {'seed':>4} {'train s':>7} {'samples/s':>9} {'idle tr/eng':>11} {'goodput':>7} "
          f"{'reward e->l':>12} {'acc end/max':>11} {f't({100 * target_accuracy:.1f}%)':>9}  staleness")
    for row in rows:
        s = row["summary"]
        reach = row["seconds_to_target"]
        eng = s.get("engine_idle_fraction")
        print(f"{row['name']:<11} {row['seed']:>4} {row['train_s']:>7.0f} {row['samples_per_s']:>9.1f} "
              f"{s['trainer_idle_fraction']:>5.2f}/{(eng if eng is not None else float('nan')):<5.2f} "
              f"{(s['goodput'] or 0):>7.3f} {s['reward_early']:>5.3f}->{s['reward_late']:<5.3f} "
              f"{100 * s['eval_accuracy_end']:>5.1f}/{100 * s['eval_accuracy_max']:<5.1f} "
              f"{'-' if reach is None else f'{reach:.0f}s':>9}  {s['staleness_hist']}")


def print_variants(variants: list[dict]) -> None:
    print(f"\nmean [min, max] over seeds\n{'run':<11} {'acc end %':>20} {'acc max %':>20} {'t(target) s':>22} "
          f"{'samples/s':>20}")
    for v in variants:
        print(f"{v['name']:<11} {Spread(**v['accuracy_end']).text('.1f', 100):>20} "
              f"{Spread(**v['accuracy_max']).text('.1f', 100):>20} "
              f"{Spread(**v['seconds_to_target']).text('.0f'):>22} "
              f"{Spread(**v['samples_per_s']).text('.0f'):>20}")


def plot(rows: list[dict], target_accuracy: float, out: Path) -> None:
    from nano_miles.observe.plots import pyplot_or_none
    plt = pyplot_or_none()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {}
    for row in rows:
        is_first = row["name"] not in colors
        color = colors.setdefault(row["name"], f"C{len(colors)}")
        label = row["name"] if is_first else None
        evals = row["summary"]["evals"]
        ax1.plot([e[2] for e in evals], [100 * e[1] for e in evals], marker="o", c=color, label=label)
        curve = row["curve"]
        window = 5
        smooth = [sum(c[1] for c in curve[max(0, i - window + 1):i + 1]) / min(i + 1, window)
                  for i in range(len(curve))]
        ax2.plot([c[0] for c in curve], smooth, c=color, label=label)
    ax1.axhline(100 * target_accuracy, ls="--", c="gray", label="target")
    ax1.set(xlabel="wall time (s)", ylabel="held-out greedy accuracy (%)", title="held-out accuracy")
    ax2.set(xlabel="wall time (s)", ylabel="mean reward (5-step average)", title="training reward")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    staleness, seeds, target_spec = [0, 1, 2, 4], [0, 1, 2], DEFAULT_TARGET_ACCURACY
    out_dir, keep_runs, from_runs, rest = RESULTS, None, None, []
    args = iter(argv)
    for arg in args:
        if arg.startswith("--staleness="):
            staleness = [int(x) for x in arg.split("=", 1)[1].split(",")]
        elif arg.startswith("--seeds="):
            seeds = [int(x) for x in arg.split("=", 1)[1].split(",")]
        elif arg.startswith("--target-accuracy="):
            target_spec = arg.split("=", 1)[1]
        elif arg.startswith("--out="):
            out_dir = Path(arg.split("=", 1)[1])
        elif arg.startswith("--keep-runs="):  # keep each run's directory (logs, metrics.jsonl) here
            keep_runs = Path(arg.split("=", 1)[1])
        elif arg.startswith("--from-runs="):  # no new runs: the tables from directories kept earlier
            from_runs = Path(arg.split("=", 1)[1])
        elif arg == "--config":  # every stage reads the same file
            os.environ["NANOMILES_CONFIG"] = str(Path(next(args)).resolve())
        else:
            rest.append(arg)
    # The CPU defaults; a --config file's own sizes stand as written.
    overrides = ([] if "NANOMILES_CONFIG" in os.environ else DEFAULTS) + rest
    variants = [("sync", overrides)] + [
        (f"async S={s}", overrides + ["--run.mode=async", f"--run.max_staleness={s}"]) for s in staleness]
    if from_runs is not None:
        rows = [read_run(name, seed, from_runs / run_dir_name(name, seed))
                for seed in seeds for name, _ in variants]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            rows = [run_variant(name, seed, ov, keep_runs or Path(tmp)) for seed in seeds for name, ov in variants]
    rows.sort(key=lambda r: [name for name, _ in variants].index(r["name"]))  # variant by variant
    target_accuracy = resolve_target_accuracy(
        target_spec, [r["summary"]["eval_accuracy_start"] for r in rows if r["name"] == "sync"])
    for row in rows:
        row["seconds_to_target"] = time_to_reach(row["summary"]["evals"], target_accuracy)
    print(f"held-out accuracy target: {100 * target_accuracy:.1f} % (--target-accuracy={target_spec})")
    print_runs(rows, target_accuracy)
    stats = aggregate(rows, target_accuracy)
    print_variants(stats)
    checks = verdicts(stats)
    if checks:
        print_verdicts(checks)
    else:
        print(f"\nno verdict: the targets are set for sync against async S={TARGET_STALENESS}, which was not run")
    out_dir.mkdir(parents=True, exist_ok=True)
    config = os.environ.get("NANOMILES_CONFIG", "configs/default.toml")
    (out_dir / "staleness.json").write_text(json.dumps({
        "config": config, "overrides": overrides, "seeds": seeds, "target_accuracy": target_accuracy,
        "target_accuracy_spec": target_spec, "runs": rows, "variants": stats,
        "verdicts": [v.to_json() for v in checks]}, indent=2))
    plot(rows, target_accuracy, out_dir / "staleness.png")
    print(f"\nwrote {out_dir / 'staleness.json'} and staleness.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
