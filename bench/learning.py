"""What `make run`'s gain is made of: the shipped policy, its habit-free twin and a control, under supervisord.

Run: python bench/learning.py [--variants shipped,habit_free,control] [--seeds 0,1,2] [--word-problems]
                               [--habit-free DIR] [--config FILE] [--out DIR] [--name NAME]
                               [--jobs N] [--keep-runs DIR] [--section.key=value ...]
On a GPU (the large policy and its habit-free build, bench/results/gpu/README.md says how):
     python bench/learning.py --config configs/gpu_large.toml --habit-free runs/policy-large-habit-free
         --out bench/results/gpu --name learning_large --jobs 7 --keep-runs runs/learning-large
         --trainer.num_steps=60 --engine.mem_fraction_static=0.08

The shipped small policy was built with a habit (nano_miles/assets/policy/README.md): in 60 % of its
warm-up answers the tag held the first step's result, `7*4=28, 28+12=40 <answer>28</answer>`. RL
removes the habit quickly, so part of any gain is the habit going away. Three variants tell the parts
apart, each started exactly as `make run` starts its run (configs/default.toml plus the overrides, in
a private run directory):

    shipped      the config's policy (seed 0 is `make run`'s own run)
    habit_free   the same recipe built without the habit (first_step_answer_rate = 0;
                 nano_miles/assets/policy_habit_free/, or --habit-free DIR)
    control      the shipped policy at trainer.lr = 0: its weights never move, so every evaluation
                 of it is the same and it runs for the first seed only

For each run: held-out greedy accuracy at the start, the mean of the last three evaluations (not the
peak: one evaluation of 200 problems is +-3 points noisy), the gain between the two, and the share of
held-out answers that tag the first step's result (the arithmetic reward's "first_step" part) at the
start and over the last three evaluations. Prints the table and writes bench/results/learning.json
and learning.png; the top level of the JSON is the first seed's shipped run, the figures `make run`
prints. With --word-problems the run is the README's own-data example instead (examples/word_problems/
through the chat template, the math reward, which has no first_step part), written to
learning_word_problems.json and .png. --config FILE reaches every stage through $NANOMILES_CONFIG;
--out DIR is where the files go (default bench/results), --name their name. --jobs N runs N pipelines
at once (on a 2-core machine keep 1: each takes about 2 cores; the figures are per step and do not
depend on it, the wall times do). --keep-runs DIR keeps every run directory there, and a run whose
directory already holds a finished run is read instead of run again: a study cut short goes on
where it stopped. The JSON is written after every finished run (`"complete": false`, the runs so far)
and again at the end with the means and the first run's figures, so a study cut short keeps its runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.learning_runs import WORD_PROBLEMS, add_study_arguments, run_once  # noqa: E402
from harness.result_file import write_result  # noqa: E402
from nano_miles.run.cli import ArgumentParser, run  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HABIT_FREE = Path(__file__).resolve().parent.parent / "nano_miles" / "assets" / "policy_habit_free"
VARIANTS = ("shipped", "habit_free", "control")
LATE = 3  # evaluations averaged for the late figure


def mean(values: list) -> float | None:
    return sum(values) / len(values) if values and None not in values else None


def figures(evals: list[dict]) -> dict:
    """Start, late mean and gain of held-out accuracy, and the first-step share at start and late."""
    late = evals[-LATE:]
    first_step = [e["parts"].get("first_step") for e in evals]
    start, late_mean = evals[0]["accuracy"], mean([e["accuracy"] for e in late])
    return {"start": start, "late_mean": late_mean, "gain": None if start is None else late_mean - start,
            "first_step_start": first_step[0], "first_step_late": mean(first_step[-LATE:])}


def run_entry(row: dict) -> dict:
    """A run as the JSON keeps it: of its summary only the wall time (its evaluations are the row's)."""
    return {k: v for k, v in row.items() if k != "summary"} | {"wall_s": row["summary"]["wall_s"]}


def variant_overrides(name: str, habit_free: Path) -> list[str]:
    return {"shipped": [], "habit_free": [f"--model.path={habit_free}"], "control": ["--trainer.lr=0"]}[name]


def pct(value: float | None, sign: str = "") -> str:
    return "–" if value is None else f"{100 * value:{sign}.1f}"


def print_table(rows: list[dict]) -> None:
    print(f"\n{'variant':<11} {'seed':>4} {'start %':>8} {'late %':>7} {'gain':>6} {'first-step tags %':>18}")
    for r in rows:
        f = r["figures"]
        shares = f"{pct(f['first_step_start'])} -> {pct(f['first_step_late'])}"
        print(f"{r['variant']:<11} {r['seed']:>4} {pct(f['start']):>8} {pct(f['late_mean']):>7} "
              f"{pct(f['gain'], '+'):>6} {shares:>18}")


def plot(rows: list[dict], out: Path, title: str) -> bool:
    from nano_miles.observe.plots import pyplot_or_none
    plt = pyplot_or_none()
    if plt is None:
        return False
    fig, (acc_ax, habit_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
    colors = dict(zip(VARIANTS, ("tab:blue", "tab:green", "tab:gray")))
    labelled = set()
    for r in rows:  # one colour per variant, a line per seed
        steps = [e["step"] for e in r["evals"]]
        label = None if r["variant"] in labelled else r["variant"].replace("_", "-")
        labelled.add(r["variant"])
        acc_ax.plot(steps, [100 * e["accuracy"] for e in r["evals"]], c=colors[r["variant"]], alpha=0.8, label=label)
        shares = [e["parts"].get("first_step") for e in r["evals"]]
        if None not in shares:
            habit_ax.plot(steps, [100 * s for s in shares], c=colors[r["variant"]], alpha=0.8, label=label)
    acc_ax.set_xlabel("step")
    acc_ax.set_ylabel("held-out greedy accuracy (%)")
    habit_ax.set_xlabel("step")
    habit_ax.set_ylabel("held-out answers tagging the first step (%)")
    acc_ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return True


def main(argv: list[str]) -> int:
    from nano_miles.run.config import ConfigError, is_override, load_config
    parser = ArgumentParser(prog="python bench/learning.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_study_arguments(parser, VARIANTS, RESULTS, None, "their name without suffix (default learning, or "
                                                          "learning_word_problems)")
    parser.add_argument("--habit-free", type=lambda v: Path(v).resolve(), default=HABIT_FREE,
                        help="the habit-free policy directory (default nano_miles/assets/policy_habit_free)")
    parser.add_argument("--word-problems", action="store_true", help="the own-data example instead")
    args = parser.parse_args([a for a in argv if not is_override(a)])
    argv = [a for a in argv if is_override(a)]
    if args.config is not None:  # every stage reads the same file
        os.environ["NANOMILES_CONFIG"] = args.config
    if "habit_free" in args.variants and not (args.habit_free / "config.json").is_file():
        print(f"--habit-free {args.habit_free} is not a policy directory: build it with `python -m "
              "nano_miles.policy build --out DIR --first-step-answer-rate 0` (and --shape as the config's)",
              file=sys.stderr)
        return 2
    where = "2 CPU cores" if args.config is None else Path(args.config).name
    if args.word_problems:
        argv = ([] if args.config else WORD_PROBLEMS) + argv
    try:
        cfg = load_config(overrides=argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    policy = Path(cfg.model.path).name or "small policy"  # e.g. policy-large; empty: the shipped one
    name, title = "learning", f"sync GRPO, {policy}, {where}"
    if args.word_problems:
        name, title = "learning_word_problems", f"sync GRPO, word problems (JSONL, chat template), {where}"
    name = args.name or name
    json_path = args.out / f"{name}.json"
    plan = [(v, s) for v in args.variants for s in (args.seeds[:1] if v == "control" else args.seeds)]
    with tempfile.TemporaryDirectory() as tmp:
        runs_dir = args.keep_runs or Path(tmp)

        def one(i: int, variant: str, seed: int) -> dict | None:
            print(f"\n=== {variant}, seed {seed} ({i + 1} of {len(plan)}) ===", flush=True)
            overrides = variant_overrides(variant, args.habit_free) + argv + [f"--run.seed={seed}"]
            summary = run_once(runs_dir / f"{variant}_seed{seed}", overrides, is_followed=args.jobs == 1)
            if summary is not None:
                print(f"{variant} seed {seed}: held-out {pct(summary['eval_accuracy_start'])} -> end "
                      f"{pct(summary['eval_accuracy_end'])} %", flush=True)
                return {"variant": variant, "seed": seed, "overrides": overrides, "evals": summary["evals"],
                        "figures": figures(summary["evals"]), "summary": summary}
            return None

        done = {}  # plan index -> row, None for a failed run
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            futures = {pool.submit(one, i, *job): i for i, job in enumerate(plan)}
            for future in as_completed(futures):
                done[futures[future]] = future.result()
                finished = [run_entry(done[i]) for i in sorted(done) if done[i] is not None]
                write_result(json_path, {"config": cfg.to_dict(), "late_evaluations": LATE, "runs": finished},
                             is_complete=False)
        rows = [done[i] for i in range(len(plan))]
    if None in rows:
        return 1
    print_table(rows)
    first = rows[0]["summary"]
    print(f"{rows[0]['variant']} seed {rows[0]['seed']}: {first['num_steps']} steps in {first['wall_s'] / 60:.1f} min "
          f"(start-up and evaluations included); held-out {pct(first['eval_accuracy_start'])} % -> max "
          f"{pct(first['eval_accuracy_max'])} %, end {pct(first['eval_accuracy_end'])} %")
    means = {v: {k: mean([r["figures"][k] for r in rows if r["variant"] == v])
                 for k in ("start", "late_mean", "gain", "first_step_start", "first_step_late")}
             for v in args.variants}
    result = {"config": cfg.to_dict(), "variant": rows[0]["variant"], "seed": rows[0]["seed"],
              **{k: first[k] for k in ("num_steps", "wall_s", "eval_accuracy_start", "eval_accuracy_max",
                                       "eval_accuracy_end", "ledger", "evals", "mean_step_s", "mean_update_ms")},
              "late_evaluations": LATE, "means": means,
              "runs": [run_entry(r) for r in rows]}
    write_result(json_path, result, is_complete=True)
    if plot(rows, args.out / f"{name}.png", title):
        print(f"wrote {args.out / name}.json and {name}.png")
    return 0


if __name__ == "__main__":
    run(main, "learning")
