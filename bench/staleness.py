"""Sync vs fully-async GRPO at several staleness bounds, same seed and sample budget, side by side.

Run: python bench/staleness.py [--staleness=0,1,2,4] [--out=DIR] [--config FILE] [--section.key=value ...]
     [--keep-runs=DIR: keep the run directories] [--from-runs=DIR: only re-read kept ones]
On a GPU: python bench/staleness.py --staleness=2 --out=bench/results/gpu --config configs/gpu.toml

Each variant is a full pipeline run under the real supervisord (sync, then async with
max_staleness S for each S). Each run's clock starts with its first step (start-up is left out).
Reported per run: training wall time, samples/s, trainer and engine idle
fractions, staleness histogram, goodput, reward early/late, held-out accuracy, and how long each async
run took to reach the sync run's final held-out accuracy (target: S = 2 within 0.8x the sync wall
time, goodput >= 0.95). Prints a table; writes staleness.json and staleness.png into --out
(default bench/results). --config FILE reaches every stage through $NANOMILES_CONFIG.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULTS = ["--trainer.num_steps=80", "--trainer.batch_groups=8", "--rollout.group_size=8",
            "--trainer.eval_every=10", "--task.num_test=200", "--trainer.checkpoint_every=0"]


def run_variant(name: str, overrides: list[str], root: Path) -> dict:
    from harness.supervised_run import SupervisedRun
    print(f"running {name} ...", flush=True)
    run = SupervisedRun(root / slug(name), overrides).start()
    try:
        if run.wait(timeout_s=3600) != 0 or not (run.run_dir / "summary.json").exists():
            raise SystemExit(f"{name} failed:\n{run.tail()}")
    finally:
        run.stop()
    return read_run(name, run.run_dir)


def slug(name: str) -> str:
    return name.replace(" ", "_").replace("=", "")


def read_run(name: str, run_dir: Path) -> dict:
    from nano_miles.observe.run_record import read_jsonl
    """One run's row. Its clock starts when step 1 starts: what comes before (engine start-up, the
    first evaluation, which on a fresh GPU host includes compiling kernels) is not training speed."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_jsonl(run_dir / "metrics.jsonl")
    t0 = records[0]["elapsed_s"] - records[0]["step_s"]
    train_s = records[-1]["elapsed_s"] - t0
    summary["evals"] = [[step, acc, max(0.0, t - t0)] for step, acc, t in summary["evals"]]
    return {"name": name, "summary": summary, "train_s": train_s, "startup_s": t0,
            "samples_per_s": sum(r["num_samples"] for r in records) / train_s,
            "curve": [[r["elapsed_s"] - t0, r["reward"]] for r in records]}


def time_to_reach(evals: list, accuracy: float) -> float | None:
    return next((t for _, acc, t in evals if acc >= accuracy - 1e-9), None)


def plot(rows: list[dict], out: Path) -> None:
    from nano_miles.observe.plots import pyplot_or_none
    plt = pyplot_or_none()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for row in rows:
        evals = row["summary"]["evals"]
        ax1.plot([e[2] for e in evals], [100 * e[1] for e in evals], marker="o", label=row["name"])
        curve = row["curve"]
        window = 5
        smooth = [sum(c[1] for c in curve[max(0, i - window + 1):i + 1]) / min(i + 1, window)
                  for i in range(len(curve))]
        ax2.plot([c[0] for c in curve], smooth, label=row["name"])
    ax1.set(xlabel="wall time (s)", ylabel="held-out greedy accuracy (%)", title="held-out accuracy")
    ax2.set(xlabel="wall time (s)", ylabel="mean reward (5-step average)", title="training reward")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    staleness, out_dir, keep_runs, from_runs, rest = [0, 1, 2, 4], RESULTS, None, None, []
    args = iter(argv)
    for arg in args:
        if arg.startswith("--staleness="):
            staleness = [int(x) for x in arg.split("=", 1)[1].split(",")]
        elif arg.startswith("--out="):
            out_dir = Path(arg.split("=", 1)[1])
        elif arg.startswith("--keep-runs="):  # keep each run's directory (logs, metrics.jsonl) here
            keep_runs = Path(arg.split("=", 1)[1])
        elif arg.startswith("--from-runs="):  # no new runs: the table from directories kept earlier
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
        rows = [read_run(name, from_runs / slug(name)) for name, _ in variants]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            rows = [run_variant(name, ov, keep_runs or Path(tmp)) for name, ov in variants]
    sync = rows[0]["summary"]
    target_acc = sync["eval_accuracy_end"]
    print(f"\n{'run':<11} {'train s':>7} {'samples/s':>9} {'':>6} {'idle tr/eng':>11} {'goodput':>7} "
          f"{'reward e->l':>12} {'acc end/max':>11} {'t(sync acc)':>11}  staleness")
    for row in rows:
        s = row["summary"]
        reach = time_to_reach(s["evals"], target_acc)
        row["seconds_to_sync_accuracy"] = reach
        row["wall_ratio_to_sync"] = None if reach is None else reach / rows[0]["train_s"]
        row["samples_per_s_ratio_to_sync"] = row["samples_per_s"] / rows[0]["samples_per_s"]
        eng = s.get("engine_idle_fraction")
        reach_text = "-" if reach is None else f"{reach:.0f}s ({reach / rows[0]['train_s']:.2f}x)"
        print(f"{row['name']:<11} {row['train_s']:>7.0f} {row['samples_per_s']:>9.1f} "
              f"{row['samples_per_s_ratio_to_sync']:>5.2f}x "
              f"{s['trainer_idle_fraction']:>5.2f}/{(eng if eng is not None else float('nan')):<5.2f} "
              f"{(s['goodput'] or 0):>7.3f} {s['reward_early']:>5.3f}->{s['reward_late']:<5.3f} "
              f"{100 * s['eval_accuracy_end']:>5.1f}/{100 * s['eval_accuracy_max']:<5.1f} "
              f"{reach_text:>11}  "
              f"{s['staleness_hist']}")
    out_dir.mkdir(parents=True, exist_ok=True)
    config = os.environ.get("NANOMILES_CONFIG", "configs/default.toml")
    (out_dir / "staleness.json").write_text(json.dumps({"config": config, "overrides": overrides,
                                                        "runs": rows}, indent=2))
    plot(rows, out_dir / "staleness.png")
    print(f"\nwrote {out_dir / 'staleness.json'} and staleness.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
