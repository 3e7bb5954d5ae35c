"""The reward stage on a slow verifier: a group scored by 1, 2, 4 and 8 forked workers, side by side.

Run: python bench/reward_workers.py [--delay-ms 50] [--group-size 16] [--groups 4] [--out FILE]

The verifier sleeps `--delay-ms` per sample (as a code-execution or symbolic check would spend its
time waiting or in another process) and then compares the answer. Each worker count scores the same
`--groups` groups of `--group-size` samples through the reward stage's own `score_group`; the table
gives seconds per group, samples per second and the speed-up over one worker, and
bench/results/reward_workers.json (or --out) keeps it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.result_file import write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WORKER_COUNTS = (1, 2, 4, 8)


def slow_verifier(response: str, label: str, *, delay_s: float) -> dict[str, float]:
    time.sleep(delay_s)
    return {"reward": float(response.strip() == label)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay-ms", type=float, default=50.0, help="the verifier's time per sample")
    parser.add_argument("--group-size", type=int, default=16, help="samples per group")
    parser.add_argument("--groups", type=int, default=4, help="groups scored per worker count")
    parser.add_argument("--out", type=Path, default=RESULTS / "reward_workers.json")
    args = parser.parse_args()

    import functools

    import numpy as np

    from nano_miles.rewards.worker import RewardWorker
    from nano_miles.stages.reward.scorer import score_group
    from nano_miles.wire.data import RolloutGroup, Sample

    verifier = functools.partial(slow_verifier, delay_s=args.delay_ms / 1000)
    samples = [Sample(np.array([i % 2], np.int32), np.zeros(1, np.float32), np.zeros(1, np.int32), "stop")
               for i in range(args.group_size)]
    groups = [RolloutGroup(f"e0-i{g}", 0, np.array([5], np.int32), samples, metadata={"label": "1"})
              for g in range(args.groups)]
    decode = lambda ids: str(int(ids[0]))  # noqa: E731
    rows = []
    print(f"{'workers':>8} {'s / group':>10} {'samples/s':>10} {'speed-up':>9}")
    for num_workers in WORKER_COUNTS:
        worker = RewardWorker(verifier, timeout_s=10.0, num_workers=num_workers)
        worker.start()
        try:
            score_group(groups[0], worker, decode)  # every child answers once before the clock starts
            started = time.perf_counter()
            for group in groups:
                scored = score_group(group, worker, decode)
                assert scored.rewards.tolist() == [float(i % 2) for i in range(args.group_size)]
            elapsed = time.perf_counter() - started
        finally:
            worker.stop()
        rows.append({"num_workers": num_workers, "seconds_per_group": elapsed / args.groups,
                     "samples_per_s": args.groups * args.group_size / elapsed})
        rows[-1]["speedup"] = rows[-1]["samples_per_s"] / rows[0]["samples_per_s"]
        r = rows[-1]
        print(f"{num_workers:>8} {r['seconds_per_group']:>10.3f} {r['samples_per_s']:>10.1f} {r['speedup']:>8.2f}x")
        write_result(args.out, {"settings": vars(args) | {"out": str(args.out)}, "rows": rows}, is_complete=False)
    write_result(args.out, {"settings": vars(args) | {"out": str(args.out)}, "rows": rows}, is_complete=True)


if __name__ == "__main__":
    main()
