"""Which algorithm variants help here: advantage estimators x policy losses, seeds side by side, one budget.

Run: python bench/algorithms.py [--variants default,rloo,...] [--seeds 0,1,2] [--config FILE]
                                [--out DIR] [--name NAME] [--jobs N] [--keep-runs DIR] [--section.key=value ...]
On a GPU (the large policy, bench/results/gpu/README.md says how):
     python bench/algorithms.py --config configs/gpu_large.toml --out bench/results/gpu --name algorithms_large
         --seeds 0 --jobs 9 --keep-runs runs/algorithms-large --engine.mem_fraction_static=0.05

Every variant is the config (configs/default.toml unless --config) plus its overrides below and the
bench's budget (BUDGET: the same steps, batch and evaluations for all), started as `make run` starts a
run, once per seed. For each: held-out greedy accuracy at the start, the mean of the last three
evaluations, the gain, the wall time, and a verdict against `default` on the gain: "helps" or "hurts"
when the variant's mean gain is outside the default's range over its seeds by more than the larger of
the two spreads (sample std), else "no difference". Three seeds cannot tell small effects apart; the
verdict says what these runs show, not what a variant does elsewhere.

Prints the table and writes <out>/<name>.json (after every finished run, `"complete": false` until the
last) and <name>.png (mean held-out curve per variant, seeds shaded). --jobs N runs N pipelines at once
(each takes about 2 CPU cores on the CPU default). --keep-runs DIR keeps every run directory and
reads a finished one instead of running it again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.learning_runs import add_study_arguments, run_once  # noqa: E402
from harness.result_file import write_result  # noqa: E402
from harness.verdict import Spread  # noqa: E402
from nano_miles.run.cli import ArgumentParser, run  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LATE = 3  # evaluations averaged for the late figure
# the same budget for every variant: 40 steps of the config's batch, held-out every 8 steps
BUDGET = ["--trainer.num_steps=40", "--trainer.eval_every=8", "--trainer.checkpoint_every=20"]
VARIANTS = {
    "default": [],                                                     # grpo advantages, dapo loss
    "grpo_batch": ["--trainer.scale_rewards=batch"],                   # TRL's batch scaling
    "dr_grpo": ["--trainer.scale_rewards=none", "--trainer.loss=dr_grpo"],  # Dr. GRPO: no std, constant norm
    "rloo": ["--trainer.advantage=rloo"],
    "reinforce_pp": ["--trainer.advantage=reinforce_pp"],
    "grpo_loss": ["--trainer.loss=grpo"],                              # per-sequence mean
    "gspo": ["--trainer.loss=gspo", "--trainer.eps_clip=3e-4", "--trainer.eps_clip_high=4e-4"],
    "cispo": ["--trainer.loss=cispo", "--trainer.eps_clip_high=4.0"],  # weights truncated at 5, as MiniMax-M1
    "two_passes": ["--trainer.num_iterations=2", "--trainer.mini_batches=2"],  # 4 optimizer steps a batch
    # at one optimizer step a batch the ratio is 1 (up to engine/trainer rounding), where gspo's gradient is
    # grpo_loss's and cispo's is default's: they differ only once the policy moves within a batch
    "gspo_two_passes": ["--trainer.loss=gspo", "--trainer.eps_clip=3e-4", "--trainer.eps_clip_high=4e-4",
                        "--trainer.num_iterations=2", "--trainer.mini_batches=2"],
    "cispo_two_passes": ["--trainer.loss=cispo", "--trainer.eps_clip_high=4.0", "--trainer.num_iterations=2",
                         "--trainer.mini_batches=2"],
}


def figures(evals: list[dict]) -> dict:
    start = evals[0]["accuracy"]
    late = sum(e["accuracy"] for e in evals[-LATE:]) / len(evals[-LATE:])
    return {"start": start, "late_mean": late, "gain": late - start}


def verdict(gains: Spread, base: Spread) -> str:
    """helps / hurts / no difference, against the default's gains (see the module's docstring); one seed
    on either side has no spread to judge by."""
    if gains.mean is None or base.mean is None:
        return "-"
    if gains.num < 2 or base.num < 2:
        return "one seed: no verdict"
    noise = max(gains.std or 0.0, base.std or 0.0)
    if gains.mean > base.max + noise:
        return "helps"
    if gains.mean < base.min - noise:
        return "hurts"
    return "no difference"


def summarize(rows: list[dict], names: list[str]) -> dict:
    out = {}
    for name in names:
        mine = [r for r in rows if r["variant"] == name]
        out[name] = {key: Spread.of([r["figures"][key] for r in mine]).to_json()
                     for key in ("start", "late_mean", "gain")}
        out[name]["wall_s"] = Spread.of([r["wall_s"] for r in mine]).to_json()
    base = out.get("default")
    for name in names:
        gains = Spread(**out[name]["gain"])
        out[name]["verdict"] = "(baseline)" if name == "default" else (
            verdict(gains, Spread(**base["gain"])) if base else "-")
    return out


def print_table(summary: dict) -> None:
    def pct(s: dict) -> str:
        return Spread(**s).text(".1f", 100)
    print(f"\n{'variant':<17} {'start %':>20} {'late %':>20} {'gain (points)':>22} {'wall s':>7}  verdict")
    for name, s in summary.items():
        print(f"{name:<17} {pct(s['start']):>20} {pct(s['late_mean']):>20} {pct(s['gain']):>22} "
              f"{s['wall_s']['mean']:>7.0f}  {s['verdict']}")


def plot(rows: list[dict], names: list[str], out: Path, title: str) -> bool:
    from nano_miles.observe.plots import pyplot_or_none
    plt = pyplot_or_none()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = plt.get_cmap("tab20").colors
    for i, name in enumerate(names):
        curves = [r["evals"] for r in rows if r["variant"] == name]
        steps = [e["step"] for e in curves[0]]
        by_step = [[100 * c[k]["accuracy"] for c in curves if k < len(c)] for k in range(len(steps))]
        mean = [sum(v) / len(v) for v in by_step]
        color = colors[(2 * i) % 20 + (2 * i) // 20]  # the strong shades first: 10 variants, then the pale ones
        ax.plot(steps, mean, label=name, lw=2 if name == "default" else 1.2, color=color)
        ax.fill_between(steps, [min(v) for v in by_step], [max(v) for v in by_step], color=color, alpha=0.08)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out greedy accuracy (%), mean over seeds")
    ax.legend(fontsize=7, ncol=3)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return True


def main(argv: list[str]) -> int:
    from nano_miles.run.config import ConfigError, is_override, load_config
    parser = ArgumentParser(prog="python bench/algorithms.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_study_arguments(parser, VARIANTS, RESULTS, "algorithms", "their name without suffix")
    parser.add_argument("--report", type=Path, default=None,
                        help="run nothing: read this result file (also one cut short), keep the runs of --variants "
                             "(default: those it has), write it back with their table and draw its PNG")
    args = parser.parse_args([a for a in argv if not is_override(a)])
    if args.report is not None:
        return report(args.report, None if "--variants" not in " ".join(argv) else args.variants)
    argv = BUDGET + [a for a in argv if is_override(a)]
    if args.config is not None:
        os.environ["NANOMILES_CONFIG"] = args.config
    try:  # every variant's config, before any run starts
        cfg = load_config(overrides=argv)
        for name in args.variants:
            load_config(overrides=VARIANTS[name] + argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    title = plot_title(cfg.to_dict(), args.config)
    json_path = args.out / f"{args.name}.json"
    plan = [(name, seed) for name in args.variants for seed in args.seeds]
    with tempfile.TemporaryDirectory() as tmp:
        runs_dir = args.keep_runs or Path(tmp)

        def one(i: int, name: str, seed: int) -> dict | None:
            print(f"=== {name}, seed {seed} ({i + 1} of {len(plan)}) ===", flush=True)
            overrides = VARIANTS[name] + argv + [f"--run.seed={seed}"]
            summary = run_once(runs_dir / f"{name}_seed{seed}", overrides, is_followed=args.jobs == 1)
            if summary is None:
                return None
            row = {"variant": name, "seed": seed, "overrides": overrides, "evals": summary["evals"],
                   "figures": figures(summary["evals"]), "wall_s": summary["wall_s"]}
            print(f"{name} seed {seed}: held-out {100 * row['figures']['start']:.1f} -> late "
                  f"{100 * row['figures']['late_mean']:.1f} % in {row['wall_s']:.0f} s", flush=True)
            return row

        done = {}
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            futures = {pool.submit(one, i, *job): i for i, job in enumerate(plan)}
            for future in as_completed(futures):
                done[futures[future]] = future.result()
                finished = [done[i] for i in sorted(done) if done[i] is not None]
                write_result(json_path, {"config": cfg.to_dict(), "variants": VARIANTS, "runs": finished},
                             is_complete=False)
    rows = [done[i] for i in range(len(plan))]
    if None in rows:
        return 1
    summary = summarize(rows, args.variants)
    print_table(summary)
    write_result(json_path, {"config": cfg.to_dict(), "variants": {n: VARIANTS[n] for n in args.variants},
                             "budget": BUDGET, "late_evaluations": LATE, "summary": summary, "runs": rows},
                 is_complete=True)
    if plot(rows, args.variants, args.out / f"{args.name}.png", title):
        print(f"wrote {json_path} and {args.name}.png")
    return 0


def plot_title(config: dict, config_file: str | None) -> str:
    policy = Path(config["model"]["path"]).name or "small policy"
    where = "CPU default config" if config_file is None else Path(config_file).name
    return f"{config['trainer']['num_steps']} sync steps, {policy}, {where}"


def report(path: Path, variants: list[str] | None) -> int:
    """Rewrite a result file from the runs it holds: those of `variants` (None: every variant with a run),
    with their summary and verdicts, and draw its PNG. The file is complete when each of those variants
    has as many runs as the first has seeds; the planned variants with no run are listed as `not_run`."""
    result = json.loads(path.read_text())
    planned = list(result.get("variants", {}))
    rows = [r for r in result["runs"] if variants is None or r["variant"] in variants]
    names = list(dict.fromkeys(r["variant"] for r in rows))
    seeds = {r["seed"] for r in rows}
    is_complete = bool(rows) and all(sum(r["variant"] == n for r in rows) == len(seeds) for n in names) \
        and (variants is None or set(variants) == set(names))
    summary = summarize(rows, names)
    print_table(summary)
    not_run = [n for n in planned if n not in names]
    if not_run:
        print(f"no run of: {', '.join(not_run)}")
    write_result(path, {"config": result["config"], "variants": {n: VARIANTS[n] for n in names},
                        "not_run": not_run, "budget": BUDGET, "late_evaluations": LATE, "summary": summary,
                        "runs": rows}, is_complete=is_complete)
    config_file = None if not result["config"]["model"]["path"] else "configs/gpu_large.toml"
    if plot(rows, names, path.with_suffix(".png"), plot_title(result["config"], config_file)):
        print(f"wrote {path} ({'complete' if is_complete else 'cut short'}) and {path.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    run(main, "algorithms")
