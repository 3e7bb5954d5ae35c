"""Sync vs fully-async GRPO at several staleness bounds, same seeds and sample budget, side by side.

Run: python bench/staleness.py [--staleness=0,1,2,4] [--seeds=0,1,2] [--target-accuracy=+4] [--out=DIR]
     [--replicas=1,2] [--speedup-target=X] [--config FILE] [--section.key=value ...]
     [--keep-runs=DIR: keep the run directories, less their checkpoints] [--from-runs=DIR: only re-read kept ones]
On a GPU: python bench/staleness.py --staleness=2 --seeds=0 --replicas=1,2 --speedup-target=1.8
          --target-accuracy=0.9 --config configs/gpu_large.toml --engine.mem_fraction_static=0.15
          --out=bench/results/gpu

Each variant (sync, then async with max_staleness S for each S) is a full pipeline run under the real
supervisord, once per seed (`--run.seed=N`). Each run's clock starts with its first step (start-up is
left out). Reported per run: training wall time, samples/s, trainer and engine idle fractions,
staleness histogram, goodput, reward early/late, held-out accuracy, the mean phase times of a step, and
the time it took to reach a
fixed held-out accuracy target, the same for every run: `--target-accuracy=A` is absolute (0.30),
`--target-accuracy=+N` is N points above the sync runs' mean start accuracy (default +4: on the CPU
defaults the sync run goes from 23 % to 28 % in its 80 steps). Per variant: the mean and [min, max]
over seeds of final and max held-out accuracy and of the time to the target.

`--replicas=1,2` runs every variant once per engine count (`--engine.replicas=N`, named "x N").

Speed-up: per engine count, each async variant's samples/s over the sync runs', beside the ideal
overlap bound taken from the sync runs' own phase times. A sync step is the producer's part
(generate + score + waiting for the resumed engine) then the trainer's (train + weight update), plus
evaluation; perfect overlap would make it max(producer, trainer) + evaluation, so the bound is
sum(step) / sum(max(producer, trainer) + eval) over the sync run's steps after the first.

Targets, one verdict each, on the means over seeds: async S = 2 reaches the accuracy target within
0.8x the sync runs' time, and its goodput is >= 0.95; with --speedup-target=X also, per engine count,
async S = 2's samples/s >= X times sync's. Prints the tables and the verdicts; writes
staleness.json (every run, the per-variant statistics, the verdicts) and staleness.png into --out
(default bench/results). --config FILE reaches every stage through $NANOMILES_CONFIG. The JSON is
written after every finished run (`"complete": false`, the runs so far) and again at the end with the
statistics and verdicts, so a bench cut short keeps the runs it finished.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.result_file import write_result  # noqa: E402
from harness.verdict import Spread, Verdict, print_verdicts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULTS = ["--trainer.num_steps=80", "--trainer.batch_groups=8", "--rollout.group_size=8",
            "--trainer.eval_every=10", "--task.num_test=200", "--trainer.checkpoint_every=0"]
DEFAULT_TARGET_ACCURACY = "+4"
TARGET_STALENESS = 2        # the variant the targets are set for
TARGET_TIME_RATIO = 0.8     # its time to the accuracy target, over the sync runs' (means over seeds)
TARGET_GOODPUT = 0.95
PRODUCER_PHASES = ("generate", "score", "waiting")  # a sync step's share that async overlaps with...
TRAINER_PHASES = ("train", "update")                # ... this one
PHASES = PRODUCER_PHASES + TRAINER_PHASES + ("eval",)


def run_variant(name: str, seed: int, overrides: list[str], root: Path) -> dict:
    from harness.learning_runs import follow
    from harness.supervised_run import SupervisedRun
    print(f"running {name}, seed {seed} ...", flush=True)
    run = SupervisedRun(root / run_dir_name(name, seed), overrides + [f"--run.seed={seed}"]).start()
    try:
        follow(run, timeout_s=3600)  # the trainer's step lines as they come: a cut run shows how far it got
        if run.proc.returncode != 0 or not (run.run_dir / "summary.json").exists():
            raise SystemExit(f"{name} (seed {seed}) failed:\n{run.tail()}")
    finally:
        run.stop()
    # a bench reads figures, not models: a run's final checkpoint goes (a full fine-tune's holds the model
    # and AdamW's state, 37 GB at Qwen2.5-3B's shape, and the next run's would not fit beside it on 64 GiB)
    shutil.rmtree(run.run_dir / "checkpoints", ignore_errors=True)
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
    summary["evals"] = [{**e, "elapsed_s": max(0.0, e["elapsed_s"] - t0)} for e in summary["evals"]]
    timed = records[1:] or records  # step 1 pays first-time costs in both modes
    return {"name": name, "seed": seed, "summary": summary, "train_s": train_s, "startup_s": t0,
            "samples_per_s": sum(r["num_samples"] for r in records) / train_s,
            "tokens_per_s": sum(r["num_tokens"] for r in records) / train_s,  # response tokens trained
            "peak_memory_mb": max(r["peak_memory_mb"] for r in records),      # the trainer's
            "phase_s": {p: sum(r["phase_s"][p] for r in timed) / len(timed) for p in PHASES},
            # a bound on overlapping a serial step: defined for sync runs (None for async ones)
            "ideal_overlap_speedup": ideal_overlap_speedup(timed) if name.startswith("sync") else None,
            "curve": [[r["elapsed_s"] - t0, r["reward"]] for r in records]}


def ideal_overlap_speedup(records: list[dict]) -> float:
    """How much faster these (sync) steps would be if generation and training overlapped perfectly:
    sum(step) / sum(max(producer, trainer) + eval), the parts as in the module docstring."""
    serial = overlapped = 0.0
    for r in records:
        phases = r["phase_s"]
        producer = sum(phases[p] for p in PRODUCER_PHASES)
        trainer = sum(phases[p] for p in TRAINER_PHASES)
        serial += producer + trainer + phases["eval"]
        overlapped += max(producer, trainer) + phases["eval"]
    return serial / overlapped if overlapped > 0 else 1.0


def time_to_reach(evals: list, accuracy: float) -> float | None:
    """Seconds until the first evaluation at or above `accuracy`; None if none was."""
    return next((e["elapsed_s"] for e in evals if e["accuracy"] >= accuracy - 1e-9), None)


def resolve_target_accuracy(spec: str, start_accuracies: list[float]) -> float:
    """`+N`: N points above the mean start accuracy; otherwise an absolute accuracy in (0, 1]."""
    if spec.startswith("+"):
        return sum(start_accuracies) / len(start_accuracies) + float(spec[1:]) / 100
    accuracy = float(spec)
    if not 0 < accuracy <= 1:
        raise ValueError(f"--target-accuracy must be in (0, 1] or +POINTS, not {spec!r}")
    return accuracy


def variant_name(mode: str, replicas: int) -> str:
    return mode if replicas == 1 else f"{mode} x{replicas}"


def make_variants(overrides: list[str], staleness: list[int], replicas: list[int]) -> list[dict]:
    """Sync, then async with each staleness bound; all of it once per engine count."""
    variants = []
    for n in replicas:
        engines = [] if n == 1 else [f"--engine.replicas={n}"]
        variants.append({"name": variant_name("sync", n), "replicas": n, "staleness": None,
                         "overrides": overrides + engines})
        variants += [{"name": variant_name(f"async S={s}", n), "replicas": n, "staleness": s,
                      "overrides": overrides + engines + ["--run.mode=async", f"--run.max_staleness={s}"]}
                     for s in staleness]
    return variants


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
            "ideal_overlap_speedup": Spread.of([r["ideal_overlap_speedup"] for r in runs]).to_json(),
            "goodput": Spread.of([r["summary"]["goodput"] for r in runs]).to_json()})
    return variants


def speedups(stats: list[dict], variants: list[dict]) -> list[dict]:
    """Per engine count and async variant: samples/s over the sync runs' (means over seeds), and the
    ideal overlap bound of those sync runs."""
    by_name = {v["name"]: v for v in stats}
    rows = []
    for v in variants:
        sync = by_name.get(variant_name("sync", v["replicas"]))
        if v["staleness"] is None or sync is None or v["name"] not in by_name:
            continue
        ratio = by_name[v["name"]]["samples_per_s"]["mean"] / sync["samples_per_s"]["mean"]
        ideal = sync["ideal_overlap_speedup"]["mean"]
        rows.append({"name": v["name"], "replicas": v["replicas"], "staleness": v["staleness"],
                     "speedup": ratio, "ideal": ideal, "of_ideal": ratio / ideal})
    return rows


def verdicts(stats: list[dict], speedup_rows: list[dict], first_replicas: int,
             speedup_target: float | None) -> list[Verdict]:
    """One verdict per target, on the means over seeds; none when the S = 2 variant was not run."""
    by_name = {v["name"]: v for v in stats}
    target = by_name.get(variant_name(f"async S={TARGET_STALENESS}", first_replicas))
    sync = by_name.get(variant_name("sync", first_replicas))
    if target is None or sync is None:
        return []
    sync_s, async_s = sync["seconds_to_target"]["mean"], target["seconds_to_target"]["mean"]
    ratio = None if sync_s is None or async_s is None or sync_s <= 0 else async_s / sync_s
    why = "the sync runs did not all reach the target" if sync_s is None else "not reached by every seed"
    checks = [Verdict(f"{target['name']} time to the accuracy target, over sync's", ratio, "<=",
                      TARGET_TIME_RATIO, "x", 2, why_none=why),
              Verdict(f"{target['name']} goodput", target["goodput"]["mean"], ">=", TARGET_GOODPUT, "", 3)]
    if speedup_target is not None:
        checks += [Verdict(f"{row['name']} samples/s over sync's", row["speedup"], ">=", speedup_target, "x", 2)
                   for row in speedup_rows if row["staleness"] == TARGET_STALENESS]
    return checks


def print_speedups(rows: list[dict]) -> None:
    print(f"\nsamples/s over sync's, with the same engines\n{'run':<16} {'engines':>7} {'speed-up':>9} "
          f"{'ideal':>6} {'of ideal':>9}")
    for row in rows:
        print(f"{row['name']:<16} {row['replicas']:>7} {row['speedup']:>8.2f}x {row['ideal']:>5.2f}x "
              f"{100 * row['of_ideal']:>8.0f}%")


def print_runs(rows: list[dict], target_accuracy: float) -> None:
    print(f"\n{'run':<16} {'seed':>4} {'train s':>7} {'samples/s':>9} {'idle tr/eng':>11} {'goodput':>7} "
          f"{'reward e->l':>12} {'acc end/max':>11} {f't({100 * target_accuracy:.1f}%)':>9}  "
          f"{'gen/score/wait/train/upd/eval s':>33}  staleness")
    for row in rows:
        s = row["summary"]
        reach = row["seconds_to_target"]
        eng = s.get("engine_idle_fraction")
        phases = "/".join(f"{row['phase_s'][p]:.2f}" for p in PHASES)
        print(f"{row['name']:<16} {row['seed']:>4} {row['train_s']:>7.0f} {row['samples_per_s']:>9.1f} "
              f"{s['trainer_idle_fraction']:>5.2f}/{(eng if eng is not None else float('nan')):<5.2f} "
              f"{(s['goodput'] or 0):>7.3f} {s['reward_early']:>5.3f}->{s['reward_late']:<5.3f} "
              f"{100 * s['eval_accuracy_end']:>5.1f}/{100 * s['eval_accuracy_max']:<5.1f} "
              f"{'-' if reach is None else f'{reach:.0f}s':>9}  {phases:>33}  {s['staleness_hist']}")


def print_variants(variants: list[dict]) -> None:
    print(f"\nmean [min, max] over seeds\n{'run':<16} {'acc end %':>20} {'acc max %':>20} {'t(target) s':>22} "
          f"{'samples/s':>20}")
    for v in variants:
        print(f"{v['name']:<16} {Spread(**v['accuracy_end']).text('.1f', 100):>20} "
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
        ax1.plot([e["elapsed_s"] for e in evals], [100 * e["accuracy"] for e in evals], marker="o", c=color, label=label)
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
    staleness, seeds, replicas, target_spec = [0, 1, 2, 4], [0, 1, 2], [1], DEFAULT_TARGET_ACCURACY
    out_dir, keep_runs, from_runs, speedup_target, rest = RESULTS, None, None, None, []
    args = iter(argv)
    for arg in args:
        if arg.startswith("--staleness="):
            staleness = [int(x) for x in arg.split("=", 1)[1].split(",")]
        elif arg.startswith("--seeds="):
            seeds = [int(x) for x in arg.split("=", 1)[1].split(",")]
        elif arg.startswith("--replicas="):
            replicas = [int(x) for x in arg.split("=", 1)[1].split(",")]
        elif arg.startswith("--target-accuracy="):
            target_spec = arg.split("=", 1)[1]
        elif arg.startswith("--speedup-target="):
            speedup_target = float(arg.split("=", 1)[1])
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
    json_path = out_dir / "staleness.json"
    config = os.environ.get("NANOMILES_CONFIG", "configs/default.toml")
    setup = {"config": config, "overrides": overrides, "seeds": seeds, "replicas": replicas}
    variants = make_variants(overrides, staleness, replicas)
    names = [v["name"] for v in variants]
    if from_runs is not None:
        kept = [(name, seed) for seed in seeds for name in names
                if (from_runs / run_dir_name(name, seed) / "summary.json").is_file()]
        missing = [run_dir_name(name, seed) for seed in seeds for name in names if (name, seed) not in kept]
        if missing:  # a run cut short leaves no summary: the tables show the rest
            print(f"not in {from_runs} (or unfinished): {', '.join(missing)}")
        if not kept:
            raise SystemExit(f"no finished run under {from_runs}")
        rows = [read_run(name, seed, from_runs / run_dir_name(name, seed)) for name, seed in kept]
    else:
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for seed in seeds:
                for v in variants:
                    rows.append(run_variant(v["name"], seed, v["overrides"], keep_runs or Path(tmp)))
                    write_result(json_path, {**setup, "runs": rows}, is_complete=False)
    rows.sort(key=lambda r: names.index(r["name"]))  # variant by variant
    sync_name = variant_name("sync", replicas[0])
    target_accuracy = resolve_target_accuracy(
        target_spec, [r["summary"]["eval_accuracy_start"] for r in rows if r["name"] == sync_name])
    for row in rows:
        row["seconds_to_target"] = time_to_reach(row["summary"]["evals"], target_accuracy)
    print(f"held-out accuracy target: {100 * target_accuracy:.1f} % (--target-accuracy={target_spec})")
    print_runs(rows, target_accuracy)
    stats = aggregate(rows, target_accuracy)
    print_variants(stats)
    speedup_rows = speedups(stats, variants)
    if speedup_rows:
        print_speedups(speedup_rows)
    checks = verdicts(stats, speedup_rows, replicas[0], speedup_target)
    if checks:
        print_verdicts(checks)
    else:
        print(f"\nno verdict: the targets are set for sync against async S={TARGET_STALENESS}, which was not run")
    write_result(json_path, {
        **setup, "target_accuracy": target_accuracy, "target_accuracy_spec": target_spec, "runs": rows,
        "variants": stats, "speedups": speedup_rows, "verdicts": [v.to_json() for v in checks]}, is_complete=True)
    plot(rows, target_accuracy, out_dir / "staleness.png")
    print(f"\nwrote {json_path} and staleness.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
