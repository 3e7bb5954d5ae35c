"""How much the tests' learning runs gain over repeated seeds: the margins the tests assert.

Run: python bench/learning_seeds.py [--seeds=0,1,2,3,4] [--configs=sync,async] [--jobs=1]

Each config of `harness/learning_runs.py` (the runs of tests/test_pipeline.py and tests/test_async.py)
runs under the real supervisord once per seed (`--run.seed`). Prints per seed the held-out accuracy
at start and best, and the training reward early and late, then the smallest gain of each config;
writes bench/results/learning_seeds.json, from which the tests take half the smallest gain as their
margin. Target: every seed gains at least 0.005 (one problem in 200; a reward of 0.005), or the
tests have nothing to assert. `--jobs=N` runs N pipelines at once (each takes about 2 cores); the
gains do not depend on it, the wall times do. The JSON is written after every finished run
(`"complete": false`, the runs so far) and again at the end with the spreads and verdicts, so a bench
cut short keeps the runs it finished; configs left out of `--configs` keep their recorded runs.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.learning_runs import CONFIGS, GAINS, RESULTS, gains  # noqa: E402
from harness.result_file import write_result  # noqa: E402
from harness.verdict import Spread, Verdict, print_verdicts  # noqa: E402

MIN_GAIN = 0.005


def run_one(config: str, seed: int, root: Path) -> dict:
    from harness.supervised_run import SupervisedRun
    started = time.monotonic()
    run = SupervisedRun(root / f"{config}-{seed}", [*CONFIGS[config], f"--run.seed={seed}"]).start()
    try:
        if run.wait(timeout_s=3600) != 0:
            raise SystemExit(f"{config} seed {seed} failed:\n{run.tail()}")
        s = run.summary()
    finally:
        run.stop()
    return {"seed": seed, "eval_start": s["eval_accuracy_start"], "eval_max": s["eval_accuracy_max"],
            "eval_end": s["eval_accuracy_end"], "reward_early": s["reward_early"], "reward_late": s["reward_late"],
            **gains(s), "wall_s": time.monotonic() - started}


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    args = dict(a.removeprefix("--").split("=", 1) for a in argv)
    seeds = [int(s) for s in args.pop("seeds", "0,1,2,3,4").split(",")]
    configs = args.pop("configs", ",".join(CONFIGS)).split(",")
    jobs = args.pop("jobs", "1")
    if args or any(c not in CONFIGS for c in configs) or not jobs.isdigit() or int(jobs) < 1:
        print(f"usage: --seeds=0,1,... --configs={','.join(CONFIGS)} --jobs=N", file=sys.stderr)
        return 2
    # the configs not run now keep their recorded seeds: the tests take every config's margin from this file
    kept = {c: v for c, v in json.loads(RESULTS.read_text())["configs"].items() if c not in configs} \
        if RESULTS.exists() else {}
    result, all_verdicts = {"seeds": seeds, "configs": dict(kept)}, []

    def run_and_show(config: str, seed: int, root: Path) -> dict:
        print(f"{config} seed {seed} ...", flush=True)
        r = run_one(config, seed, root)
        print(f"  {config} seed {seed}: held-out {100 * r['eval_start']:.1f} -> max {100 * r['eval_max']:.1f} %, "
              f"reward {r['reward_early']:.3f} -> {r['reward_late']:.3f} ({r['wall_s']:.0f} s)", flush=True)
        return r

    def finished_runs(done: dict) -> dict:
        """Per config, its finished runs in seed order."""
        return {**kept, **{c: {"overrides": CONFIGS[c], "runs": [done[c, s] for s in seeds if (c, s) in done]}
                           for c in configs if any((c, s) in done for s in seeds)}}

    done = {}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(int(jobs)) as pool:
        futures = {pool.submit(run_and_show, c, s, Path(tmp)): (c, s) for c in configs for s in seeds}
        for future in as_completed(futures):
            if future.exception() is None:  # a failed run's error is raised below, once the others are in
                done[futures[future]] = future.result()
                write_result(RESULTS, {"seeds": seeds, "configs": finished_runs(done)}, is_complete=False)
    for future in futures:
        future.result()
    for config in configs:
        runs = [done[config, seed] for seed in seeds]
        verdicts = [Verdict(f"{config} {g}, smallest over seeds", min(r[g] for r in runs), ">=", MIN_GAIN,
                            digits=3) for g in GAINS]
        result["configs"][config] = {
            "overrides": CONFIGS[config], "runs": runs,
            "spread": {g: Spread.of([r[g] for r in runs]).to_json() for g in GAINS},
            "verdicts": [v.to_json() for v in verdicts]}
        all_verdicts += verdicts
    print(f"\n{'config':<8} {'gain':<12} {'mean [min, max] over seeds':>28}")
    for config, c in result["configs"].items():
        if config in kept:
            continue
        for g in GAINS:
            print(f"{config:<8} {g:<12} {Spread.of([r[g] for r in c['runs']]).text('+.3f'):>28}")
    print_verdicts(all_verdicts)
    write_result(RESULTS, result, is_complete=True)
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
