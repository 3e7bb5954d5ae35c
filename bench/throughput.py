"""Pipeline throughput under the real supervisord: tokens/s, per-stage busy share, the step split and
the pipeline's own overhead (share of step time outside generate + train; target <= 2 % per variant,
each verdict printed and kept in the JSON).

Run: python bench/throughput.py [--section.key=value ...] [--vs --section.key=value ...]
e.g. python bench/throughput.py --vs --run.mode=async --run.max_staleness=2
Overrides before the first `--vs` apply to every variant; each `--vs` adds a variant, and all
variants run one after another in this invocation and are printed side by side. The default budget
is 24 steps of 8 groups x 8 samples (1,536 samples); step 1 (warm-up) and the final evaluation are
left out of the averages. Writes bench/results/throughput.json and throughput.png; the JSON after every
finished variant (`"complete": false`, the variants so far) and again at the end with the verdicts, so a
bench cut short keeps the variants it finished.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.result_file import write_result  # noqa: E402
from harness.verdict import Verdict, print_verdicts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BUDGET = ["--trainer.num_steps=24", "--trainer.batch_groups=8", "--rollout.group_size=8",
          "--trainer.eval_every=0", "--task.num_test=20", "--trainer.checkpoint_every=0"]
PHASES = ("generate", "score", "train", "update", "waiting")
TARGET_OVERHEAD_PERCENT = 2.0  # share of step time outside generate + train, per variant


def run_variant(overrides: list[str], timeout_s: float = 1800) -> dict:
    """One supervised run; scrapes every stage twice a second until the run ends by itself."""
    from harness.supervised_run import SupervisedRun
    from nano_miles.observe.metrics import HOP_ENGINE
    from nano_miles.observe.scrape import goodput, scrape_all, stage_urls
    from nano_miles.run.config import load_config
    with tempfile.TemporaryDirectory() as tmp:
        run = SupervisedRun(Path(tmp) / "run", BUDGET + overrides).start()
        urls = stage_urls(load_config(overrides=run.overrides))
        first, last = {}, {}  # per stage: first scrape after step 1, last scrape seen
        deadline = time.monotonic() + timeout_s
        try:
            while run.proc.poll() is None:
                if time.monotonic() > deadline:
                    raise SystemExit(f"run did not finish in {timeout_s:.0f}s:\n{run.tail()}")
                snaps = scrape_all(urls, timeout_s=0.5)
                trainer = snaps["trainer"]
                # the window: from the end of step 1 to the trainer's last answer (after it, the
                # others only idle until supervisord stops them)
                is_measuring = trainer is not None and trainer.get("nanomiles_step", 0) >= 1
                for stage, snap in snaps.items():
                    if snap is not None and is_measuring:
                        first.setdefault(stage, snap)
                        last[stage] = snap
                time.sleep(0.5)
        finally:
            run.stop()
        records = [r for r in run.metrics() if "phase_s" in r][1:]
        if not records or not (run.run_dir / "summary.json").exists():
            raise SystemExit(f"the run failed:\n{run.tail()}")

    def per_s(stage: str, name: str, **labels) -> float:
        a, b = first[stage], last[stage]
        return (b.get(name, 0.0, **labels) - a.get(name, 0.0, **labels)) / max(1e-9, b.time_s - a.time_s)

    steps = {p: sum(r["phase_s"][p] for r in records) / len(records) for p in PHASES}
    step_s = sum(r["step_s"] - r["phase_s"]["eval"] for r in records) / len(records)
    return {"overrides": overrides, "num_steps_measured": len(records),
            "generate_tokens_per_s": per_s("rollout", "nanomiles_tokens_received_total", hop=HOP_ENGINE),
            "train_tokens_per_s": per_s("trainer", "nanomiles_trained_tokens_total"),
            "busy_share": {s: per_s(s, "process_cpu_seconds_total") for s in first},
            "step_s": step_s, "phase_s": steps,
            "overhead_share": 1 - (steps["generate"] + steps["train"]) / step_s,
            "goodput": goodput(last),
            "mean_update_split_ms": {k: sum(r["update_split_ms"][k] for r in records) / len(records)
                                     for k in records[0]["update_split_ms"]}}


def table(names: list[str], results: list[dict]) -> str:
    rows = [("generated tokens/s", lambda r: f"{r['generate_tokens_per_s']:.1f}"),
            ("trained tokens/s", lambda r: f"{r['train_tokens_per_s']:.1f}"),
            ("goodput", lambda r: f"{100 * (r['goodput'] or 0):.1f}%")]
    rows += [(f"busy (cpu) {s}", lambda r, s=s: f"{100 * r['busy_share'].get(s, 0):.0f}%")
             for s in ("engine", "rollout", "reward", "trainer")]
    rows += [("step s", lambda r: f"{r['step_s']:.3f}")]
    rows += [(f"  {p} s", lambda r, p=p: f"{r['phase_s'][p]:.3f} ({100 * r['phase_s'][p] / r['step_s']:.1f}%)")
             for p in PHASES]
    rows += [("overhead (not gen+train)", lambda r: f"{100 * r['overhead_share']:.2f}%")]
    width = max(20, *(len(n) for n in names))
    lines = [f"{'':<26}" + "".join(f"{n:>{width + 2}}" for n in names)]
    lines += [f"{label:<26}" + "".join(f"{fn(r):>{width + 2}}" for r in results) for label, fn in rows]
    return "\n".join(lines)


def plot(names: list[str], results: list[dict], out: Path) -> bool:
    from nano_miles.observe.plots import pyplot_or_none
    plt = pyplot_or_none()
    if plt is None:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    bottoms = [0.0] * len(results)
    for p in PHASES:
        values = [r["phase_s"][p] for r in results]
        ax1.bar(names, values, bottom=bottoms, label=p)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax1.set_ylabel("seconds per step")
    ax1.set_title("where a step's time goes")
    ax1.legend(fontsize=8)
    stages = ("engine", "rollout", "reward", "trainer")
    width = 0.8 / len(results)
    for i, (name, r) in enumerate(zip(names, results)):
        ax2.bar([j + i * width for j in range(len(stages))], [100 * r["busy_share"].get(s, 0) for s in stages],
                width, label=name)
    ax2.set_xticks([j + 0.4 - width / 2 for j in range(len(stages))], stages)
    ax2.set_ylabel("CPU busy (% of one core)")
    ax2.set_title("per-stage busy share")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return True


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    groups, current = [], []
    for arg in argv:
        if arg == "--vs":
            groups.append(current)
            current = []
        else:
            current.append(arg)
    groups.append(current)
    common, extra = groups[0], groups[1:]
    variants = [common] + [common + v for v in extra]
    names = [" ".join(v[len(common):]).replace("--run.", "") or "baseline" for v in variants]
    names[0] = " ".join(common).replace("--run.", "") or "sync (default)"
    from nano_miles.run.config import ConfigError, load_config
    try:
        configs = [load_config(overrides=BUDGET + v) for v in variants]
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    def result_json() -> dict:
        """The file's content for the variants run so far."""
        done = names[:len(results)]
        return {"budget": BUDGET, "variants": dict(zip(done, results)),
                "configs": {n: c.to_dict() for n, c in zip(done, configs)}}

    results = []
    for name, v in zip(names, variants):
        print(f"running {name} ...", flush=True)
        results.append(run_variant(v))
        write_result(RESULTS / "throughput.json", result_json(), is_complete=False)
    print()
    print(table(names, results))
    verdicts = [Verdict(f"overhead, {name}", 100 * r["overhead_share"], "<=", TARGET_OVERHEAD_PERCENT, "%", 2)
                for name, r in zip(names, results)]
    print_verdicts(verdicts)
    for r, v in zip(results, verdicts):
        r["verdict"] = v.to_json()
    write_result(RESULTS / "throughput.json", result_json(), is_complete=True)
    written = "throughput.json" + (" and throughput.png" if plot(names, results, RESULTS / "throughput.png") else "")
    print(f"\nwrote {written} in {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
