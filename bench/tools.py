"""What the calculator tool is worth: the same policy trained with its tool and without, seeds side by side.

Run: python bench/tools.py [--seeds 0,1] [--config configs/tools.toml] [--out DIR] [--name NAME] [--jobs N]
                           [--keep-runs DIR] [--section.key=value ...]
On a GPU (the large policy taught the tool, bench/results/gpu/README.md says how):
     python bench/tools.py --config configs/gpu_tools.toml --out bench/results/gpu --name tools_large --seeds 0

Two variants of the config (configs/tools.toml unless --config), each run as `make run` runs it, for
the same budget: `tool`, the config as it is (the calculator's rollout, the system turn that offers
the tool), and `no_tool`, the same policy, data and reward with one turn and no offer, so that it
answers by working the steps itself. For each: held-out greedy accuracy at the start (what the
policy can do with and without its tool before any RL), the mean of the last three evaluations, and
the gain. Prints the table and writes <out>/<name>.json (after every finished run) and <name>.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.algorithms import figures, plot  # noqa: E402
from harness.learning_runs import add_study_arguments, run_once  # noqa: E402
from harness.result_file import write_result  # noqa: E402
from harness.verdict import Spread  # noqa: E402
from nano_miles.run.cli import ArgumentParser, run  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tools.toml"
BUDGET = ["--trainer.num_steps=40", "--trainer.eval_every=8"]
VARIANTS = {
    "tool": [],
    "no_tool": ["--rollout.fn=nano_miles.rollouts.single_turn:rollout", "--task.system_prompt=",
                "--rollout.max_turns=1", "--rollout.max_new_tokens=48"],
}


def main(argv: list[str]) -> int:
    from nano_miles.run.config import is_override, load_config
    parser = ArgumentParser(prog="python bench/tools.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_study_arguments(parser, VARIANTS, RESULTS, "tools", "their name without suffix")
    args = parser.parse_args([a for a in argv if not is_override(a)])
    os.environ["NANOMILES_CONFIG"] = args.config or str(CONFIG)
    argv = BUDGET + [a for a in argv if is_override(a)]
    cfg = load_config(overrides=argv)  # a config mistake: one line, before anything runs
    for name in args.variants:
        load_config(overrides=VARIANTS[name] + argv)
    json_path, plan = args.out / f"{args.name}.json", [(n, seed) for n in args.variants for seed in args.seeds]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max(1, args.jobs)) as pool:
        runs_dir = args.keep_runs or Path(tmp)

        def one(name: str, seed: int) -> dict | None:
            print(f"=== {name}, seed {seed} ===", flush=True)
            overrides = VARIANTS[name] + argv + [f"--run.seed={seed}"]
            summary = run_once(runs_dir / f"{name}_seed{seed}", overrides, is_followed=args.jobs == 1)
            return None if summary is None else {
                "variant": name, "seed": seed, "overrides": overrides, "evals": summary["evals"],
                "figures": figures(summary["evals"]), "wall_s": summary["wall_s"]}
        rows = []
        for row in pool.map(lambda job: one(*job), plan):
            if row is None:
                return 1
            rows.append(row)
            write_result(json_path, {"config": cfg.to_dict(), "variants": VARIANTS, "runs": rows}, is_complete=False)
    table = {name: {key: Spread.of([r["figures"][key] for r in rows if r["variant"] == name]).to_json()
                    for key in ("start", "late_mean", "gain")} for name in args.variants}
    print(f"\n{'variant':<9} {'start %':>20} {'late %':>20} {'gain (points)':>22}")
    for name, s in table.items():
        print(f"{name:<9} " + " ".join(f"{Spread(**s[k]).text('.1f', 100):>20}" for k in ("start", "late_mean", "gain")))
    write_result(json_path, {"config": cfg.to_dict(), "variants": VARIANTS, "budget": BUDGET, "summary": table,
                             "runs": rows}, is_complete=True)
    title = f"{cfg.trainer.num_steps} sync steps, {Path(cfg.model.path).name}, with and without the calculator"
    if plot(rows, args.variants, args.out / f"{args.name}.png", title):
        print(f"wrote {json_path} and {args.name}.png")
    return 0


if __name__ == "__main__":
    run(main, "tools")
