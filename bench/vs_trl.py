"""nano-miles (sync, async S=2) against Hugging Face TRL's GRPOTrainer: same GPU, policy, data and settings.

Run: python bench/vs_trl.py [--policies medium,large | --shapes 0.5b,1.5b | --model DIR] [--steps 50]
                            [--out DIR] [--name vs_trl] [--trl-pythonpath PATH] [--trl-generation generate|paged]
                            [--runs sync,async,trl] [--section.key=value ...]
     python bench/vs_trl.py --from A.json B.json [--out DIR] [--name NAME]   (earlier results, reported together)
On one GPU, after building the policies (python -m nano_miles.policy build --shape medium|large
--device cuda --out runs/policy-medium|large) and with trl importable (pip install trl; a host
without network: bash bench/trl_bundle.sh, then --trl-pythonpath):
     python bench/vs_trl.py --engine.mem_fraction_static=0.05 --out bench/results/gpu
On the CPU (the small policy, the local engine; a check that everything runs, not a speed figure):
     python bench/vs_trl.py --policies small --steps 4
At real model sizes: --shapes runs Qwen2.5's shapes with random weights (harness/model_shapes.py; built
into --models on the first run), --model any local model directory; both on the large policy's config
with MODEL_OVERRIDES (64 samples x 256 new tokens a step, bf16 autocast, checkpointing on both sides).
A random model learns nothing: its rows have speed targets only (SHAPE_TARGETS), no accuracy target, and
its runs evaluate a few problems before step 1 and after the last only (SHAPE_OVERRIDES).

Per policy, three runs of the same number of optimizer steps from the same policy directory:
nano-miles sync and async with max_staleness 2 (each a full pipeline under the real supervisord,
configs/gpu.toml or gpu_large.toml with the overrides), then TRL's GRPOTrainer in a process of its
own (harness/trl_grpo.py) with the settings mapped from the same config. Both sides' settings, TRL's
read back from its built trainer, are printed side by side; one that should match and does not stops
the bench. Every run's clock starts when its step 1 starts; TRL's stops while the held-out evaluation
(nano-miles' own, in its process) runs.

Reported per run: samples/s and generated tokens/s over the training time, seconds per step and its
generate / train split, time to the held-out target (the runs' mean start accuracy plus the policy's
--target-points), start and final held-out accuracy, peak GPU memory (the whole device, NVML: the
engine's reserved pool included; and the trainer's max allocated) and the weight update per step.
Writes vs_trl.json and vs_trl.png (held-out accuracy against wall time) into --out (default
bench/results). Targets: nano-miles ahead of TRL in samples/s and time to target on every policy,
async S=2 at >= 3x TRL's samples/s on the large policy, final accuracy not below TRL's by more than
the 3-point noise of 200 held-out problems. The JSON is written after every run (`"complete": false`,
the runs so far) and again at the end with the targets and verdicts, so a bench cut short keeps its
runs, and `--from` takes them. TRL's process writes a line as each step ends to trl.log in its run
directory (`--keep-runs DIR` puts the run directories where they outlast the bench). Where one sitting
cannot hold all three runs, `--runs sync,async` and `--runs trl` make them in two benches on one machine,
and `--from` both files compares them (it refuses runs made with other settings or on another device,
and a policy that lacks one of the three runs in every file).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.result_file import write_result  # noqa: E402
from harness.servers import REPO_ROOT  # noqa: E402
from harness.trl_grpo import MUST_MATCH, nano_settings  # noqa: E402
from harness.verdict import Verdict, print_verdicts  # noqa: E402
from nano_miles.run.cli import ArgumentParser, UserError, run  # noqa: E402
from nano_miles.run.config import is_override, load_config  # noqa: E402
from staleness import time_to_reach  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# policy -> (its config, held-out points above the runs' mean start that count as the target)
POLICIES = {"small": ("configs/default.toml", 3.0), "medium": ("configs/gpu.toml", 8.0),
            "large": ("configs/gpu_large.toml", 50.0)}
LARGE_ASYNC_TARGET = 3.0   # async S=2 samples/s over TRL's on the large policy
MODEL_CONFIG = "configs/gpu_large.toml"  # the settings a --model or --shapes run starts from, with these:
MODEL_OVERRIDES = ["--trainer.dtype=bfloat16", "--trainer.gradient_checkpointing=true", "--trainer.batch_groups=4",
                   "--rollout.max_new_tokens=256"]
SHAPE_TARGETS = (5.0, 8.0)  # sync, async S=2 samples/s over TRL's at Qwen2.5's shapes
# Random weights score 0 held-out: a shape's runs evaluate 8 problems, before step 1 and after the last only
# (TRL's side evaluates through transformers' generate, one call per prompt length: slow at these sizes)
SHAPE_OVERRIDES = ["--trainer.eval_every=0", "--task.num_test=8"]
ACCURACY_NOISE = 0.03      # final accuracy may trail TRL's by this much (200 problems: ~3 points)
RUNS = ("sync", "async", "trl")  # every policy's runs, in the order a bench runs them


def title(key: str) -> str:
    """How a section of the results is named: "large policy", "Qwen2.5-1.5b shape", a model directory's name."""
    return f"{key} policy" if key in POLICIES else key


def print_settings(policy: str, nano: dict, trl: dict) -> list[str]:
    """Both sides' settings, row by row; the MUST_MATCH keys that differ."""
    print(f"\nsettings, {title(policy)}\n{'setting':<32} {'nano-miles':<48} {'TRL GRPOTrainer':<48}")
    for key in nano:
        mark = "" if key not in MUST_MATCH else ("  same" if nano[key] == trl.get(key) else "  DIFFERS")
        print(f"{key:<32} {str(nano[key]):<48} {str(trl.get(key)):<48}{mark}")
    return [k for k in MUST_MATCH if nano[k] != trl.get(k)]


class DeviceMemory:
    """The GPUs' used memory (NVML, every process, summed over every GPU the host has: engines laid out
    on GPUs of their own count too) sampled while the block runs: the peak above what was in use when
    it started, in MiB. None without a GPU or NVML."""

    def __init__(self, period_s: float = 0.2):
        self.period_s, self.peak_mb, self._stop = period_s, None, threading.Event()

    def __enter__(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # no NVML library or no GPU: memory is not reported
            return self
        if not handles:
            return self
        used = lambda: sum(pynvml.nvmlDeviceGetMemoryInfo(h).used for h in handles) / 2**20  # noqa: E731
        base = used()
        self.peak_mb = 0.0

        def sample():
            while not self._stop.wait(self.period_s):
                self.peak_mb = max(self.peak_mb, used() - base)
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.peak_mb is not None:
            self._thread.join()


def trl_env(pythonpath: str | None) -> dict:
    """TRL's process: the repo importable, PYTHONPATH replaced by `pythonpath` if given (so an
    engine's pinned packages stay out of it), no hub access."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1"}
    paths = ([pythonpath] if pythonpath is not None else [env.get("PYTHONPATH", "")]) + [str(REPO_ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def check_trl(env: dict) -> str:
    out = subprocess.run([sys.executable, "-c", "import trl, datasets, transformers; print(trl.__version__, "
                          "datasets.__version__, transformers.__version__)"], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise UserError("TRL does not import in its process: " + out.stderr.strip().splitlines()[-1]
                        + " (pip install trl, or bash bench/trl_bundle.sh DIR and --trl-pythonpath)")
    return out.stdout.strip()


def run_nano(name: str, config: str, overrides: list[str], root: Path) -> dict:
    from staleness import run_variant  # a pipeline run under supervisord, read as staleness.py reads it
    os.environ["NANOMILES_CONFIG"] = config
    with DeviceMemory() as memory:
        row = run_variant(name, 0, overrides, root)
    s = row["summary"]
    return {"name": f"nano-miles {name}", "train_s": row["train_s"], "samples_per_s": row["samples_per_s"],
            "tokens_per_s": row["tokens_per_s"], "num_steps": s["num_steps"],
            "step_s": row["train_s"] / s["num_steps"],
            # the trainer's wait for a scored batch: generation and scoring it could not overlap
            "generate_s": sum(row["phase_s"][p] for p in ("generate", "score", "waiting")),
            "train_step_s": row["phase_s"]["train"], "update_ms": s["mean_update_ms"], "evals": s["evals"],
            # none above idle: the run was finished before this bench (read back from --keep-runs), unmeasured
            "device_memory_mb": memory.peak_mb or None, "trainer_memory_mb": row["peak_memory_mb"],
            "goodput": s["goodput"]}


def run_trl(config: str, overrides: list[str], generation: str, env: dict, root: Path) -> dict:
    out = root / "trl" / "trl_run.json"
    log = out.with_name("trl.log")  # its progress a step at a time, kept when the bench is cut short
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"running TRL GRPOTrainer ({generation}), its log in {log} ...", flush=True)
    cmd = [sys.executable, "-m", "harness.trl_grpo", "--config", config, "--out", str(out),
           "--generation", generation, *overrides]
    with DeviceMemory() as memory, log.open("w") as sink:
        done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"TRL run failed:\n{log.read_text()[-4000:]}")
    r = json.loads(out.read_text())
    steps = r["steps"]
    timed = steps[1:] or steps  # step 1 pays first-time costs, as in the nano-miles runs
    mean = lambda key: sum(s["phase_s"][key] for s in timed) / len(timed)  # noqa: E731
    return {"name": f"TRL {generation}", "train_s": r["train_s"],
            "samples_per_s": sum(s["num_samples"] for s in steps) / r["train_s"],
            "tokens_per_s": sum(s["num_tokens"] for s in steps) / r["train_s"], "num_steps": len(steps),
            "step_s": r["train_s"] / len(steps), "generate_s": mean("generate") + mean("score"),
            "train_step_s": mean("train"), "update_ms": None, "evals": r["evals"],
            "device_memory_mb": memory.peak_mb, "trainer_memory_mb": r["peak_memory_mb"], "goodput": 1.0,
            "settings": r["settings"], "trl_version": r["trl_version"]}


def fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def print_table(policy: str, rows: list[dict], target: float | None) -> None:
    aim = "speed only, no accuracy target" if target is None else f"target {100 * target:.1f} % held-out"
    print(f"\n{title(policy)}, {aim}\n{'run':<22} {'samples/s':>9} {'tokens/s':>9} "
          f"{'s/step':>7} {'batch s':>7} {'train s':>7} {'t(target)':>9} {'held-out start -> end':>22} "
          f"{'GPU MiB':>8} {'trainer MiB':>11} {'update ms':>9}")
    for r in rows:
        acc = f"{100 * r['evals'][0]['accuracy']:.1f} -> {100 * r['evals'][-1]['accuracy']:.1f} %"
        print(f"{r['name']:<22} {r['samples_per_s']:>9.0f} {r['tokens_per_s']:>9.0f} {r['step_s']:>7.3f} "
              f"{r['generate_s']:>7.3f} {r['train_step_s']:>7.3f} {fmt(r['seconds_to_target'], '.0f'):>8}s "
              f"{acc:>22} {fmt(r['device_memory_mb'], ',.0f'):>8} {fmt(r['trainer_memory_mb'], ',.0f'):>11} "
              f"{fmt(r['update_ms'], '.1f', 'none'):>9}")


@dataclass
class Entry:
    """What one section of the comparison runs: a policy of the project's, a real model shape or a model directory."""

    name: str                       # how its rows are named
    config: str                     # the config file, relative to the repo
    overrides: list[str]            # on top of it and the bench's defaults, before the user's
    target_points: float | None     # held-out points above the runs' mean start that count as the target
    speed_targets: tuple[float, float]  # sync and async S=2 samples/s over TRL's


def entries(args) -> list[Entry]:
    if args.model is not None:
        return [Entry(args.model.name, MODEL_CONFIG, [f"--model.path={args.model}"] + MODEL_OVERRIDES, None, (1.0, 1.0))]
    if args.shapes:
        from harness.model_shapes import SHAPES
        if unknown := [s for s in args.shapes.split(",") if s not in SHAPES]:
            raise UserError(f"--shapes takes names from {', '.join(SHAPES)}, not {', '.join(unknown)}")
        return [Entry(f"Qwen2.5-{s} shape", MODEL_CONFIG,
                      [f"--model.path={args.models / s}"] + MODEL_OVERRIDES + SHAPE_OVERRIDES, None, SHAPE_TARGETS)
                for s in args.shapes.split(",")]
    if unknown := [p for p in args.policies.split(",") if p not in POLICIES]:
        raise UserError(f"--policies takes names from {', '.join(POLICIES)}, not {', '.join(unknown)}")
    return [Entry(p, POLICIES[p][0], [], POLICIES[p][1], (1.0, LARGE_ASYNC_TARGET if p == "large" else 1.0))
            for p in args.policies.split(",")]


def policy_verdicts(policy: str, res: dict) -> list[Verdict]:
    rows = res["runs"]
    trl, sync, asyn = rows["trl"], rows["sync"], rows["async"]
    # results written before the speed targets were kept: the policies' own
    targets = res.get("speed_targets") or (1.0, LARGE_ASYNC_TARGET if policy == "large" else 1.0)
    checks = [Verdict(f"{policy}: {r['name']} samples/s over TRL's", r["samples_per_s"] / trl["samples_per_s"], ">=",
                      target, "x", 2) for r, target in zip((sync, asyn), targets)]
    if res["target_accuracy"] is None:  # random weights: speed is all there is to compare
        return checks
    best = min((r["seconds_to_target"] for r in (sync, asyn) if r["seconds_to_target"] is not None), default=None)
    ratio = None if best is None else 0.0 if trl["seconds_to_target"] is None else best / trl["seconds_to_target"]
    checks.append(Verdict(f"{policy}: nano-miles' time to target over TRL's", ratio, "<=", 1.0, "x", 2))
    checks += [Verdict(f"{policy}: {r['name']} final held-out accuracy minus TRL's",
                       100 * (r["evals"][-1]["accuracy"] - trl["evals"][-1]["accuracy"]), ">=", -100 * ACCURACY_NOISE, "points")
               for r in (sync, asyn)]
    return checks


def plot(results: dict, out: Path) -> None:
    from nano_miles.observe.plots import pyplot_or_none
    plt = pyplot_or_none()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (policy, res) in zip(axes[0], results.items()):
        for key, row in res["runs"].items():
            ax.plot([e["elapsed_s"] for e in row["evals"]], [100 * e["accuracy"] for e in row["evals"]], marker="o", label=row["name"])
        if res["target_accuracy"] is not None:
            ax.axhline(100 * res["target_accuracy"], ls="--", c="gray", label="target")
        ax.set(xlabel="training wall time (s)", ylabel="held-out greedy accuracy (%)", title=title(policy))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def measure(entry: Entry, overrides: list[str], generation: str, env: dict, root: Path, runs: list[str],
            on_run: Callable[[dict], None]) -> dict:
    """The `runs` of one entry (its config with `overrides`) and both sides' settings; `on_run` is handed
    the entry's result so far after each run."""
    import torch
    config = str(REPO_ROOT / entry.config)
    starts = {"sync": lambda: run_nano("sync", config, overrides, root),
              "async": lambda: run_nano("async S=2", config, overrides + ["--run.mode=async",
                                                                         "--run.max_staleness=2"], root),
              "trl": lambda: run_trl(config, overrides, generation, env, root)}
    result = {"config": entry.config, "overrides": overrides, "target_points": entry.target_points,
              "speed_targets": list(entry.speed_targets),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "nano_settings": nano_settings(load_config(config, overrides)), "runs": {}}
    for key in runs:
        result["runs"][key] = starts[key]()
        on_run(result)
    return result


def merged(paths: list[Path]) -> dict:
    """The policies of earlier results, the runs of one policy gathered from every file that holds some
    (made with the same settings on the same device, e.g. by `--runs` in two benches on one machine)."""
    results: dict = {}
    for path in paths:
        if not path.is_file():
            raise UserError(f"--from {path}: no such file")
        earlier = json.loads(path.read_text())  # a bench cut short wrote the runs it finished: those count
        for policy, res in earlier["policies"].items():
            have = results.setdefault(policy, {**res, "runs": {}})
            if [have.get(k) for k in ("overrides", "device")] != [res.get(k) for k in ("overrides", "device")]:
                raise UserError(f"--from {path}: its {policy} runs had other settings or another device than "
                                f"the earlier files' ({res.get('device')} against {have.get('device')})")
            if twice := sorted(have["runs"].keys() & res["runs"].keys()):
                raise UserError(f"--from {path}: {policy} has its {', '.join(twice)} run in an earlier file too")
            have["runs"].update(res["runs"])
    for policy, res in results.items():
        if missing := [k for k in RUNS if k not in res["runs"]]:
            raise UserError(f"--from: no file holds the {', '.join(missing)} run of {policy}")
    return results


def report(results: dict, out: Path, name: str) -> None:
    """Settings side by side (stopping on a mismatch), the table and the verdicts of every policy;
    `name`.json and `name`.png into `out`."""
    for p, res in results.items():
        starts = [r["evals"][0]["accuracy"] for r in res["runs"].values()]  # the target: points above their mean
        res["target_accuracy"] = (None if res["target_points"] is None
                                  else sum(starts) / len(starts) + res["target_points"] / 100)
        for r in res["runs"].values():
            r["seconds_to_target"] = (None if res["target_accuracy"] is None
                                      else time_to_reach(r["evals"], res["target_accuracy"]))
        differs = print_settings(p, res["nano_settings"], res["runs"]["trl"]["settings"])
        if differs:
            raise SystemExit(f"settings that should match differ: {', '.join(differs)}")
        print_table(p, list(res["runs"].values()), res["target_accuracy"])
    checks = [v for p in results for v in policy_verdicts(p, results[p])]
    print_verdicts(checks)
    for p, res in results.items():
        res["verdicts"] = [v.to_json() for v in checks if v.name.startswith(f"{p}:")]
    write_result(out / f"{name}.json", {"policies": results}, is_complete=True)
    plot(results, out / f"{name}.png")
    print(f"\nwrote {out / name}.json and {name}.png")


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python bench/vs_trl.py", description=__doc__)
    parser.add_argument("--policies", default="medium,large", help="comma-separated: small, medium, large")
    parser.add_argument("--shapes", default="", help="instead: Qwen2.5's shapes, comma-separated (0.5b, 1.5b, 3b, 7b)")
    parser.add_argument("--models", type=Path, default=REPO_ROOT / "runs" / "shapes",
                        help="where the shapes' model directories are (built there if missing)")
    parser.add_argument("--model", type=Path, default=None, help="instead: one local model directory")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps of every run")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON and PNG go")
    parser.add_argument("--name", default="vs_trl", help="their file name, without suffix")
    parser.add_argument("--trl-pythonpath", default=None,
                        help="PYTHONPATH of TRL's process instead of this one's (e.g. the bundle's site)")
    parser.add_argument("--trl-generation", choices=("generate", "paged"), default="generate",
                        help="TRL's generation: model.generate or transformers' paged continuous batching")
    parser.add_argument("--keep-runs", type=Path, default=None, help="keep every run's directory here")
    parser.add_argument("--runs", default=",".join(RUNS), help="which of sync, async, trl to run (the others: "
                        "another bench's, joined by --from)")
    parser.add_argument("--from", dest="from_files", type=Path, nargs="+", default=None,
                        help="no new runs: report the policies of these earlier JSON results together")
    args = parser.parse_args([a for a in argv if not is_override(a)])
    if args.from_files is not None:
        report(merged(args.from_files), args.out, args.name)
        return 0
    if args.steps < 1:
        raise UserError("--steps takes a positive count")
    runs = list(dict.fromkeys(args.runs.split(",")))
    if unknown := [r for r in runs if r not in RUNS]:
        raise UserError(f"--runs takes names from {', '.join(RUNS)}, not {', '.join(map(repr, unknown))}")
    chosen = entries(args)
    defaults = [f"--trainer.num_steps={args.steps}", f"--trainer.eval_every={max(1, args.steps // 6)}",
                "--trainer.checkpoint_every=0", "--run.seed=0"]
    overrides = {e.name: defaults + e.overrides + [a for a in argv if is_override(a)] for e in chosen}
    for e in chosen:
        model_dir = load_config(REPO_ROOT / e.config, overrides[e.name]).model_dir
        if (model_dir / "config.json").is_file():
            continue
        if args.model is not None:
            raise UserError(f"--model {model_dir}: no config.json there")
        if e.name in POLICIES:
            raise UserError(f"the {e.name} policy is not at {model_dir}: python -m nano_miles.policy build "
                            f"--shape {e.name} --device cuda --out {model_dir}")
        from harness.model_shapes import built
        built(model_dir.name, model_dir)  # a shape: its directory is built here, once
    env = trl_env(args.trl_pythonpath)
    print(f"trl, datasets, transformers in TRL's process: {check_trl(env)}")
    results = {}

    def save(name: str, so_far: dict) -> None:
        results[name] = so_far
        write_result(args.out / f"{args.name}.json", {"policies": results}, is_complete=False)

    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep_runs or Path(tmp)
        for e in chosen:
            results[e.name] = measure(e, overrides[e.name], args.trl_generation, env, root / e.name.replace(" ", "_"),
                                      runs, lambda so_far, name=e.name: save(name, so_far))
    if set(runs) != set(RUNS):  # a part of the comparison: complete as asked, reported with the rest
        write_result(args.out / f"{args.name}.json", {"policies": results}, is_complete=True)
        print(f"wrote {args.out / args.name}.json: the {args.runs} runs; with the file of the others, "
              "python bench/vs_trl.py --from A.json B.json compares them")
        return 0
    report(results, args.out, args.name)
    return 0


if __name__ == "__main__":
    run(main, "vs_trl")
