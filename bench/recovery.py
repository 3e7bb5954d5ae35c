"""How long the pipeline stalls when one stage is SIGKILLed, for each stage, with the default 60 s lease.

Run: python bench/recovery.py [--out=DIR] [--section.key=value ...]

One pipeline run under the real supervisord; every STEPS_BETWEEN steps one stage is killed (engine,
rollout, reward, trainer). Reported per kill: seconds until supervisord had the stage running again,
seconds until the first step newer than the last one before the kill, and that time in steps of the
run's median step time, and how long that first step waited for its batch (what the kill cost beyond
the stage's own start-up; target: at most 3 steps' time, a verdict per stage). Prints a table and the
verdicts; writes recovery.json into --out (default bench/results): `{"complete": ..., "kills": [...]}`,
each kill with its verdict. It is written after every kill (`"complete": false`, the kills so far, their
step-time figures still missing) and again when the run has ended, so a bench cut short keeps its kills.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.result_file import write_result  # noqa: E402
from harness.verdict import Verdict, print_verdicts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
STAGES = ("engine", "rollout", "reward", "trainer")
STEPS_BETWEEN = 8
TARGET_WAIT_STEPS = 3.0  # the first step after a kill waits at most this many median steps for its batch
DEFAULTS = [f"--trainer.num_steps={STEPS_BETWEEN * (len(STAGES) + 1)}", "--trainer.batch_groups=8",
            "--rollout.group_size=4", "--trainer.eval_every=0", "--task.num_test=10",
            "--trainer.checkpoint_every=4"]


def measure(overrides: list[str], root: Path, out: Path) -> list[dict]:
    """The kills, each written to `out` as soon as the pipeline has taken its next step."""
    from harness.supervised_run import SupervisedRun
    run = SupervisedRun(root / "run", DEFAULTS + overrides).start()
    kills = []
    try:
        for i, stage in enumerate(STAGES):
            run.wait_for_step(STEPS_BETWEEN * (i + 1))
            print(f"killing {stage} after step {max(run.steps())} ...", flush=True)
            kill = run.kill(stage)
            kill["first_step_wait_s"] = (kill.pop("next_step") or {}).get("wait_s")
            kills.append(kill)
            write_result(out, {"kills": kills}, is_complete=False)
        if run.wait(timeout_s=1800) != 0:
            raise SystemExit(f"the run failed:\n{run.tail()}")
    finally:
        run.stop()
    step_s = statistics.median(r["step_s"] for r in run.steps().values())
    for k in kills:
        k.update(step_s=step_s, next_step_in_steps=k["next_step_s"] / step_s)
    return kills


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    out = next((Path(a.split("=", 1)[1]) for a in argv if a.startswith("--out=")), RESULTS) / "recovery.json"
    overrides = [a for a in argv if not a.startswith("--out=")]
    with tempfile.TemporaryDirectory() as tmp:
        kills = measure(overrides, Path(tmp), out)
    print(f"{'stage killed':<14}{'running again s':>16}{'next step s':>13}{'in steps':>10}{'its wait s':>12}")
    for k in kills:
        wait = k["first_step_wait_s"]
        print(f"{k['stage']:<14}{k['restarted_s']:>16.1f}{k['next_step_s']:>13.1f}{k['next_step_in_steps']:>10.1f}"
              f"{'-' if wait is None else format(wait, '.2f'):>12}")
    print(f"median step time {kills[0]['step_s']:.2f} s")
    verdicts = []
    for k in kills:
        wait = k["first_step_wait_s"]
        verdicts.append(Verdict(f"first step's wait after killing {k['stage']}",
                                None if wait is None else wait / k["step_s"], "<=", TARGET_WAIT_STEPS,
                                "steps", why_none="no step record"))
        k["verdict"] = verdicts[-1].to_json()
    print_verdicts(verdicts)
    write_result(out, {"kills": kills}, is_complete=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
