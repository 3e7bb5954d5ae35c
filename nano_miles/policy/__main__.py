"""Builds, sweeps and evaluates the project's small policy (the package docstring says what it is).
Run: python -m nano_miles.policy {build,sweep,eval} --help
"""

import argparse
import re
import time
from pathlib import Path

from nano_miles.run.cli import ArgumentParser, UserError, run

SHAPES = ("large", "medium", "small")  # build.MODEL_SHAPES, named here so --help needs no torch
FORMAT_NAMES = ("raw", "chat", "word", "tool")  # formats.FORMATS, likewise
NUM_TEST = 1945  # the smallest test split of the formats (word problems), so --num fits every one


def held_out_count(text: str) -> int:
    """--num / --num-eval: a number of held-out problems, at most what every format's test split holds."""
    num = int(text) if text.isdigit() else -1
    if not 1 <= num <= NUM_TEST:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, {NUM_TEST}], not {text!r}")
    return num


def format_list(text: str) -> tuple[str, ...]:
    formats = tuple(text.split(","))
    if not formats or not set(formats) <= set(FORMAT_NAMES):
        raise argparse.ArgumentTypeError(f"takes formats of {', '.join(FORMAT_NAMES)}, comma-separated, not {text!r}")
    return formats


def answer_rate(text: str) -> float:
    """--first-step-answer-rate: a share in [0, 1]."""
    try:
        rate = float(text)
    except ValueError:
        rate = -1.0
    if not 0.0 <= rate <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], not {text!r}")
    return rate


def device_name(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", text):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, not {text!r}")
    return text


def parse_args(argv):
    import nano_miles.policy as package
    parser = ArgumentParser(prog="python -m nano_miles.policy", description=package.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build the tokenizer and model from a seed and warm them up")
    build.add_argument("--out", type=Path, required=True, help="output directory (HF format)")
    build.add_argument("--seed", type=int, default=0, help="seed for the weights and the data order")
    build.add_argument("--num-steps", type=int, default=None, help="supervised warm-up steps (default: the shape's)")
    sweep_cmd = sub.add_parser("sweep", help="one long warm-up, evaluated and saved every --eval-every steps")
    sweep_cmd.add_argument("--out", type=Path, required=True, help="directory for step<N>/ snapshots and sweep.json")
    sweep_cmd.add_argument("--num-steps", type=int, required=True, help="supervised warm-up steps")
    sweep_cmd.add_argument("--eval-every", type=int, required=True, help="evaluate and save every N steps")
    sweep_cmd.add_argument("--seed", type=int, default=0, help="seed for the weights and the data order")
    sweep_cmd.add_argument("--num-eval", type=held_out_count, default=200,
                           help="number of test problems per format and evaluation")
    for cmd in (build, sweep_cmd):
        cmd.add_argument("--shape", choices=SHAPES, default="small",
                         help="model size: small (the shipped CPU policy), medium (the quick GPU demo, 3.2 M) "
                              "or large (39.5 M, the GPU's real curve)")
        cmd.add_argument("--formats", type=format_list, default=None,
                         help=f"comma-separated formats to teach, of {', '.join(FORMAT_NAMES)} (default: the shape's)")
        cmd.add_argument("--init", type=Path, default=None,
                         help="go on from this policy directory instead of new weights, e.g. the large policy "
                              "with --formats word --num-steps 200")
        cmd.add_argument("--device", type=device_name, default="cpu", help="torch device of the warm-up, e.g. cuda")
        cmd.add_argument("--first-step-answer-rate", type=answer_rate, default=None,
                         help="share of taught answers whose tag holds the first step's result (default: the "
                              "shape's, 0.6 for small and large; 0 builds the habit-free policy)")
    evaluate = sub.add_parser("eval", help="greedy accuracy, format rate and pass@k on held-out problems, "
                                           "in every format")
    evaluate.add_argument("--model", type=Path, required=True, help="any local HF causal-LM directory")
    evaluate.add_argument("--num", type=held_out_count, default=200, help="number of test problems per format")
    evaluate.add_argument("--num-samples", type=int, default=8, help="k of pass@k at temperature 1 (0: skip)")
    evaluate.add_argument("--seed", type=int, default=0, help="sampling seed")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if getattr(args, "device", "cpu").startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise UserError(f"--device {args.device}, but torch {torch.__version__} sees no CUDA device here")
    for flag, model_dir in (("--model", getattr(args, "model", None)), ("--init", getattr(args, "init", None))):
        if model_dir is not None and not (model_dir / "config.json").is_file():
            raise UserError(f"{flag} {model_dir} is not a local HF model directory (no config.json there)")
    start_s = time.monotonic()
    if args.command == "build":
        from nano_miles.policy.build import build_policy
        build_policy(args.out, seed=args.seed, shape=args.shape, num_steps=args.num_steps, device=args.device,
                     formats=args.formats, init_dir=args.init, first_step_answer_rate=args.first_step_answer_rate)
        print(f"built {args.out} in {time.monotonic() - start_s:.0f}s")
    elif args.command == "sweep":
        from nano_miles.policy.build import sweep
        sweep(args.out, shape=args.shape, num_steps=args.num_steps, eval_every=args.eval_every,
              device=args.device, seed=args.seed, num_eval=args.num_eval, formats=args.formats, init_dir=args.init,
              first_step_answer_rate=args.first_step_answer_rate)
    else:
        from nano_miles.policy.evaluate import evaluate_dir
        result = evaluate_dir(args.model, num=args.num, num_samples=args.num_samples, seed=args.seed)
        print(" ".join(f"{k} {v:.3f}" for k, v in result.items()) + f" ({time.monotonic() - start_s:.0f}s)")


if __name__ == "__main__":
    run(main, "policy")
