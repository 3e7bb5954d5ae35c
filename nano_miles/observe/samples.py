"""Prints what the model writes: the latest whole samples of a run, from its samples.jsonl.

Run: python -m nano_miles.observe.samples [RUN_DIR] [--num N] [--step K]   (default runs/current, the 4 latest)

The trainer keeps `metrics.samples_per_step` samples of every step it trains: the prompt exactly as
it was sent (chat template and special tokens included), the response as generated (its stop token
included), token counts, the reward and its parts, and the weight version that generated it. A
multi-turn sample is shown turn by turn, each marked as the model's (trained) or its environment's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nano_miles.observe.run_record import read_jsonl
from nano_miles.run.cli import ArgumentParser, UserError, run

RULE = "-" * 72


def format_sample(s: dict) -> str:
    parts = " ".join(f"{k} {v:g}" for k, v in s["reward_parts"].items())
    head = (f"step {s['step']} | {s['group_id']} sample {s['sample']} | version {s['version']} | "
            f"reward {s['reward']:g}{' (' + parts + ')' if parts else ''} | advantage {s['advantage']:+.3f} | "
            f"{s['num_prompt_tokens']} prompt + {s['num_response_tokens']} response tokens, {s['finish_reason']}")
    if "turns" not in s:
        return "\n".join([RULE, head, f"label: {s['label']}", "prompt:", s["prompt"], "response:", s["response"]])
    turns = [f"[{'model, trained' if t['trained'] else 'environment, not trained'}]\n{t['text']}" for t in s["turns"]]
    return "\n".join([RULE, head, f"label: {s['label']}", "prompt:", s["prompt"], "trajectory:", *turns])


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m nano_miles.observe.samples", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", nargs="?", type=Path, default=Path("runs/current"), help="the run directory")
    parser.add_argument("--num", type=int, default=4, help="how many samples to print (default 4)")
    parser.add_argument("--step", type=int, default=None, help="the samples of this step (default: the latest)")
    args = parser.parse_args(argv)
    path = args.run_dir / "samples.jsonl"
    if not path.is_file():
        raise UserError(f"no {path}: not a run directory, or the run keeps no samples (metrics.samples_per_step=0)")
    samples = read_jsonl(path)
    if args.step is not None:
        samples = [s for s in samples if s["step"] == args.step]
        if not samples:
            raise UserError(f"{path} holds no samples of step {args.step}")
    for s in samples[-args.num:]:
        print(format_sample(s))
    return 0


if __name__ == "__main__":
    run(main, "samples")
