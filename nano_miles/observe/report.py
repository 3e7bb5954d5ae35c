"""Prints the outcome of a finished run from its directory: summary.json and its plots, or why it failed.

Run: python -m nano_miles.observe.report [RUN_DIR]   (default runs/current); exit 1 if the run failed.
"""

from __future__ import annotations

import json
from pathlib import Path

from nano_miles.run.cli import ArgumentParser, UserError, run


def held_out_line(s: dict) -> str:
    """Held-out accuracy start / max / end; mean reward for a reward function without accuracy."""
    if s.get("eval_accuracy_start") is not None:
        return (f"  held-out accuracy        start {100 * s['eval_accuracy_start']:.1f}%  "
                f"max {100 * s['eval_accuracy_max']:.1f}%  end {100 * s['eval_accuracy_end']:.1f}%  "
                f"(max - start {100 * s['eval_accuracy_delta']:+.1f} points)")
    if s.get("eval_reward_start") is not None:
        return (f"  held-out mean reward     start {s['eval_reward_start']:.3f}  max {s['eval_reward_max']:.3f}  "
                f"end {s['eval_reward_end']:.3f}")
    return "  held-out                 not evaluated"


def report(run_dir: Path) -> tuple[str, bool]:
    failed = run_dir / "FAILED"
    if failed.exists():
        return f"run failed: {failed.read_text().strip()} (logs in {run_dir})", False
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        return f"no summary in {run_dir}: the run was stopped before it finished", False
    s = json.loads(summary_path.read_text())
    lines = [
        f"run summary ({run_dir})",
        f"  steps                    {s['num_steps']}",
        f"  mean reward early/late   {s['reward_early']:.3f} -> {s['reward_late']:.3f} "
        f"({s['reward_delta']:+.3f})",
        held_out_line(s),
        f"  mean step time           {s['mean_step_s']:.2f}s (weight update {s['mean_update_ms']:.0f}ms)",
        f"  max staleness            {s['staleness_max']}",
    ]
    if "ledger" in s:
        led = s["ledger"]
        lines.append(f"  prompts                  {led['num_prompts']}: {led['num_trained_once']} trained once, "
                     f"{led['num_trained_twice']} twice, {led['num_lost']} lost, "
                     f"{led.get('num_unfinished', 0)} unfinished at the end (ledger.json)")
    plots = ", ".join(str(p) for p in sorted(run_dir.glob("*.png")))
    lines.append(f"  plots                    {plots or 'none (metrics.plots is off, or see trainer.log)'}")
    return "\n".join(lines), True


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m nano_miles.observe.report", description=__doc__)
    parser.add_argument("run_dir", nargs="?", type=Path, default=Path("runs/current"), help="the run directory")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        raise UserError(f"{args.run_dir} is not a directory (a run directory, e.g. runs/current)")
    text, ok = report(args.run_dir)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    run(main, "report")
