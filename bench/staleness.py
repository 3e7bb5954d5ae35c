"""Sync vs fully-async GRPO at several staleness bounds, same seed and sample budget, side by side.

Run: python bench/staleness.py [--staleness 0,1,2,4] [--section.key=value ...]

Each variant is a full pipeline run under the real supervisord (sync, then async with
max_staleness S for each S). Reported per run: wall time, samples/s, trainer and engine idle
fractions, staleness histogram, goodput, reward early/late, held-out accuracy, and how long each async
run took to reach the sync run's final held-out accuracy (target: S = 2 within 0.8x the sync wall
time, goodput >= 0.95). Prints a table; writes bench/results/staleness.json and staleness.png.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULTS = ["--trainer.num_steps=80", "--trainer.batch_groups=8", "--rollout.group_size=8",
            "--trainer.eval_every=10", "--task.num_test=200", "--trainer.checkpoint_every=0"]


def run_variant(name: str, overrides: list[str], root: Path) -> dict:
    from nano_miles.supervised_run import SupervisedRun
    print(f"running {name} ...", flush=True)
    run = SupervisedRun(root / name.replace(" ", "_").replace("=", ""), overrides).start()
    try:
        if run.wait(timeout_s=3600) != 0 or not (run.run_dir / "summary.json").exists():
            raise SystemExit(f"{name} failed:\n{run.tail()}")
    finally:
        run.stop()
    summary, records = run.summary(), run.metrics()
    num_samples = sum(r["num_samples"] for r in records)
    return {"name": name, "summary": summary, "samples_per_s": num_samples / summary["wall_s"],
            "curve": [[r["elapsed_s"], r["reward"]] for r in records]}


def time_to_reach(evals: list, accuracy: float) -> float | None:
    return next((t for _, acc, t in evals if acc >= accuracy - 1e-9), None)


def plot(rows: list[dict], out: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no PNG written")
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
    staleness = [0, 1, 2, 4]
    rest = []
    for arg in argv:
        if arg.startswith("--staleness="):
            staleness = [int(x) for x in arg.split("=", 1)[1].split(",")]
        else:
            rest.append(arg)
    overrides = DEFAULTS + rest
    variants = [("sync", overrides)] + [
        (f"async S={s}", overrides + ["--run.mode=async", f"--run.max_staleness={s}"]) for s in staleness]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_variant(name, ov, Path(tmp)) for name, ov in variants]
    sync = rows[0]["summary"]
    target_acc = sync["eval_accuracy_end"]
    print(f"\n{'run':<11} {'wall s':>7} {'samples/s':>9} {'idle tr/eng':>11} {'goodput':>7} "
          f"{'reward e->l':>12} {'acc end/max':>11} {'t(sync acc)':>11}  staleness")
    for row in rows:
        s = row["summary"]
        reach = time_to_reach(s["evals"], target_acc)
        row["seconds_to_sync_accuracy"] = reach
        row["wall_ratio_to_sync"] = None if reach is None else reach / sync["wall_s"]
        eng = s.get("engine_idle_fraction")
        reach_text = "-" if reach is None else f"{reach:.0f}s ({reach / sync['wall_s']:.2f}x)"
        print(f"{row['name']:<11} {s['wall_s']:>7.0f} {row['samples_per_s']:>9.1f} "
              f"{s['trainer_idle_fraction']:>5.2f}/{(eng if eng is not None else float('nan')):<5.2f} "
              f"{(s['goodput'] or 0):>7.3f} {s['reward_early']:>5.3f}->{s['reward_late']:<5.3f} "
              f"{100 * s['eval_accuracy_end']:>5.1f}/{100 * s['eval_accuracy_max']:<5.1f} "
              f"{reach_text:>11}  "
              f"{s['staleness_hist']}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "staleness.json").write_text(json.dumps({"overrides": overrides, "runs": rows}, indent=2))
    plot(rows, RESULTS / "staleness.png")
    print(f"\nwrote {RESULTS / 'staleness.json'} and staleness.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
