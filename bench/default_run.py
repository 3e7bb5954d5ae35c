"""The default pipeline as `make run` runs it, from a fresh start: the figures of the README's set-up.

Run: python bench/default_run.py [--runs=2] [--out=FILE] [--section.key=value ...]

Each run is configs/default.toml (plus any overrides) under the real supervisord, in a private run
directory on private endpoints: what `make run` starts, less the report it prints at the end. Kept
per run: steps, the run's wall time from supervisord's start to its exit (start-up, evaluations and
shutdown included: what a user waits for), training time from the first step to the last, held-out
accuracy at start / max / end with every evaluation, mean step time and mean weight-update time.
Prints a table; writes bench/results/default_run.json (or --out).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).resolve().parent / "results"


def one_run(run_dir: Path, overrides: list[str], timeout_s: float) -> dict:
    from learning import follow

    from harness.supervised_run import SupervisedRun
    from nano_miles.observe.run_record import read_jsonl
    started = time.monotonic()
    run = SupervisedRun(run_dir, overrides).start()
    try:
        follow(run, timeout_s)
    finally:
        run.stop()
    wall_s = time.monotonic() - started
    if run.proc.returncode != 0 or not (run.run_dir / "summary.json").exists():
        raise SystemExit(f"the run failed:\n{run.tail()}")
    summary = run.summary()
    records = read_jsonl(run.run_dir / "metrics.jsonl")
    t0 = records[0]["elapsed_s"] - records[0]["step_s"]
    return {"num_steps": summary["num_steps"], "wall_s": wall_s, "train_s": records[-1]["elapsed_s"] - t0,
            "eval_accuracy_start": summary["eval_accuracy_start"], "eval_accuracy_max": summary["eval_accuracy_max"],
            "eval_accuracy_end": summary["eval_accuracy_end"], "evals": summary["evals"],
            "mean_step_s": summary["mean_step_s"], "mean_update_ms": summary["mean_update_ms"],
            "ledger": summary["ledger"]}


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    num_runs, out, overrides = 2, RESULTS / "default_run.json", []
    for arg in argv:
        if arg.startswith("--runs="):
            num_runs = int(arg.split("=", 1)[1])
        elif arg.startswith("--out="):
            out = Path(arg.split("=", 1)[1])
        else:
            overrides.append(arg)
    from nano_miles.run.config import ConfigError, load_config
    try:
        cfg = load_config(overrides=overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if num_runs < 1:
        print("--runs must be >= 1", file=sys.stderr)
        return 2
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(num_runs):
            print(f"run {i + 1} of {num_runs} ...", flush=True)
            runs.append(one_run(Path(tmp) / f"run{i}", overrides, timeout_s=3 * 3600))
    print(f"\n{'run':>4} {'steps':>6} {'wall min':>9} {'train s':>8} {'held-out start/max/end %':>25} "
          f"{'update ms':>10}")
    for i, r in enumerate(runs, 1):
        accuracy = "/".join(f"{100 * r[f'eval_accuracy_{k}']:.1f}" for k in ("start", "max", "end"))
        print(f"{i:>4} {r['num_steps']:>6} {r['wall_s'] / 60:>9.1f} {r['train_s']:>8.0f} {accuracy:>25} "
              f"{r['mean_update_ms']:>10.1f}")
    import torch
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "config": cfg.to_dict(), "overrides": overrides, "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "torch": torch.__version__, "unix_time": time.time(),
        "runs": runs}, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
