"""Every measured figure the README and bench/results/gpu/README.md quote is read back from a committed result.

A claim is a doc's exact text with `{}` for each figure, and for each figure the file under
bench/results/ it comes from, the path to it in that file and a formatter. A re-run of a bench that
changes a figure fails here, with what the result now says, until the doc says it too. The library's
line counts, which the README gives as "about", are counted from the tree and may drift a little.
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from test_layout import MAX_MODULE_LINES

from conftest import REPO

RESULTS = REPO / "bench" / "results"
README = "README.md"
GPU = "bench/results/gpu/README.md"
# benches a time limit ended after some runs, whose finished runs the GPU README quotes, saying so
CUT_SHORT = {"gpu/scale_0.5b_h100.json", "gpu/scale_0.5b_compile_h100.json", "gpu/full_3b_h100.json"}
LINE_TOLERANCE = 0.03  # relative; "about N lines" may lag the tree by this much (or one rounding step)


@dataclass(frozen=True)
class Fig:
    """One figure: `file` under bench/results/, `path` into it, `fmt` to the doc's text. A path step is
    a key, a list index, {field: value, ...} (the list element with those fields) or a function."""

    file: str
    path: tuple
    fmt: Callable[[object], str]


@dataclass(frozen=True)
class Claim:
    doc: str
    text: str    # the doc's text, whitespace as it likes; "{}" for each figure
    figs: tuple


def pct(digits: int):
    return lambda v: f"{100 * v:.{digits}f}"


def num(digits: int):
    return lambda v: f"{v:.{digits}f}"


def grouped(v) -> str:
    return f"{v:,.0f}"


def pct_short(v) -> str:
    """85.5, 82, 85: a percentage with a decimal only when it has one."""
    return f"{round(100 * v, 1):g}"


def text(v) -> str:
    return str(v)


def F(file: str, *path, fmt=text) -> Fig:
    return Fig(file, path, fmt)


def C(doc: str, template: str, *figs: Fig) -> Claim:
    assert template.count("{}") == len(figs), template
    return Claim(doc, template, figs)


def first_step_pct(v: float) -> str:
    """A first-step share as the README's table gives it: 0 plain, others to one decimal."""
    return "0" if v == 0 else f"{100 * v:.1f}"


# derived figures, each read off one result file
def training_s(summary: dict) -> float:
    """Seconds from the end of the first evaluation to the last one: the run's training time."""
    return summary["evals"][-1]["elapsed_s"] - summary["evals"][0]["elapsed_s"]


def first_eval_at(summary: dict, accuracy: float) -> dict | None:
    """The first evaluation at or above `accuracy`, or None."""
    return next((e for e in summary["evals"] if e["accuracy"] >= accuracy - 1e-9), None)


def first_reached(accuracy: float, *, since_start: bool = True) -> Callable[[dict], str]:
    """`step N, T s` of the first evaluation at or above `accuracy`, or `not in N steps`."""
    def read(summary: dict) -> str:
        hit = first_eval_at(summary, accuracy)
        if hit is None:
            return f"not in {summary['num_steps']} steps"
        t0 = summary["evals"][0]["elapsed_s"] if since_start else 0.0
        return f"step {hit['step']}, {hit['elapsed_s'] - t0:.0f} s"
    return read


def step_at(accuracy: float) -> Callable[[dict], int | None]:
    """The step of the first evaluation at or above `accuracy` (None if none was)."""
    return lambda summary: (first_eval_at(summary, accuracy) or {}).get("step")


def step_of_max(summary: dict) -> int:
    return next(e["step"] for e in summary["evals"] if e["accuracy"] == summary["eval_accuracy_max"])


def staleness_counts(summary: dict) -> str:
    return " / ".join(f"{summary['staleness_hist'].get(str(k), 0):,}" for k in range(3))


def per_step(summary: dict) -> int:
    """Prompts per step."""
    return summary["ledger"]["num_prompts"] // summary["num_steps"]


def per_prompt(summary: dict) -> int:
    """Samples per prompt."""
    return sum(summary["staleness_hist"].values()) // summary["ledger"]["num_prompts"]


def override(name: str) -> Callable[[dict], str]:
    return lambda result: [o.split("=", 1)[1] for o in result["overrides"] if o.startswith(f"--{name}=")][-1]


def pytest_summary(log: str) -> Callable[[str], str]:
    """`5 passed, 1 deselected in 150.18` from the summary line of `log` in gpu_tests.txt."""
    return lambda txt: re.search(rf"^{re.escape(log)}:=+ (.+?)s \(", txt, re.M).group(1)


SWEEP, SYNC = "gpu/policy_sweep.json", "gpu/sync_run.json"
LARGE, LARGE_RL = "gpu/large_sync_run_450.json", "gpu/staleness_large.json"
STALE, B16 = "gpu/staleness.json", "gpu/staleness_b16_g8.json"
TESTS, LAYOUT, WS_GPU = "gpu/gpu_tests.json", "gpu/gpu_tests_layout.json", "gpu/weight_sync_gpu.json"
ENGINES, WAKEUP, SUITE2 = "gpu/staleness_engines.json", "gpu/update_wakeup.json", "gpu/gpu_tests_replicas.json"
S, A = ("runs", 0, "summary"), ("runs", 1, "summary")  # staleness.json: the sync and the async run's summaries
WS_CPU = "weight_sync.json"


def ws_rows(result) -> list:
    """weight_sync.json's rows: `{"complete": ..., "rows": [...]}`, or a bare list as the bench wrote it
    before it said whether it finished."""
    return result if isinstance(result, list) else result["rows"]


FLAT, ONE = ("paths", "flat"), ("paths", "one-tensor")


def sweep_row(step: int, template: str) -> Claim:
    row = ("rows", {"step": step})
    return C(GPU, template, F(SWEEP, *row, "warmup_s", fmt=num(0)), F(SWEEP, *row, "greedy_accuracy", fmt=pct(1)),
             F(SWEEP, *row, "pass@8", fmt=pct(1)))


def update_row(path: str) -> Claim:
    p = ("paths", path)
    return C(GPU, f"| {path} | {{}} | {{}} | {{}} | {{}} | {{}} |",
             *(F(WS_GPU, *p, k, fmt=num(2)) for k in ("total_ms", "p90_ms", "gather_ms", "serialize_ms", "apply_ms")))


def engines_row(i: int, label: str, speedup: int | None) -> Claim:
    """A row of the sync/async x 1/2 engines table; `speedup`: its index in the speed-up rows (async)."""
    run, is_async = ("runs", i), speedup is not None
    samples = "{} (**{}×**)" if is_async else "{}"
    generate = "–" if is_async else "{}"
    speed = [F(ENGINES, "speedups", speedup, "speedup", fmt=num(2))] if is_async else []
    gen = [] if is_async else [F(ENGINES, *run, "phase_s", "generate", fmt=num(2))]
    return C(GPU, f"| {label} | {{}} | {samples} | {{}} → {{}} / {{}} % | {{}} s | {{}} | {generate} / {{}} | {{}} |",
             F(ENGINES, *run, "train_s", fmt=num(0)), F(ENGINES, *run, "samples_per_s", fmt=num(0)), *speed,
             *(F(ENGINES, *run, "summary", k, fmt=pct(1))
               for k in ("eval_accuracy_start", "eval_accuracy_max", "eval_accuracy_end")),
             F(ENGINES, *run, "summary", lambda s: first_eval_at(s, 0.85)["elapsed_s"], fmt=num(0)),
             F(ENGINES, *run, "summary", "goodput", fmt=num(3)), *gen,
             F(ENGINES, *run, "phase_s", "train", fmt=num(2)), F(ENGINES, *run, "summary", "mean_update_ms", fmt=num(1)))


def wakeup_row(label: str, condition: str) -> Claim:
    return C(GPU, f"| {label} | {{}} | {{}} |",
             *(F(WAKEUP, "pause_modes", mode, condition, "apply_ms", fmt=num(2)) for mode in ("in_place", "abort")))


def suite_counts(summary: str) -> str:
    """`7 passed, 2 skipped` from a pytest summary line (deselected ones left out)."""
    return ", ".join(re.findall(r"\d+ (?:passed|skipped|failed)", summary))


def suite_seconds(summary: str) -> float:
    """323.01 from `... in 323.01s`."""
    return float(re.search(r"in ([\d.]+)s", summary).group(1))


VS_TRL, WORD_GPU = "gpu/vs_trl.json", "gpu/learning_word_problems.json"
PROFILE = "gpu/gpu_tests_profile.json"
CHUNKS = "gpu/logit_chunks_0.5b.json"  # the compiled 0.5B step at two log-prob chunk sizes


def compute_s(kinds: dict) -> float:
    """A profiled step's kernel time: every kind but the GPU's idle wait for the host."""
    return sum(s for kind, s in kinds.items() if kind != "GPU idle (host)")


def matmul_s(kinds: dict) -> float:
    return kinds["matrix multiply"] + kinds["attention"]


def memory_bound_s(kinds: dict) -> float:
    """Casts, copies and the other element-wise kernels and reductions."""
    return kinds["copy / cast"] + kinds["elementwise / reductions"]


COMPILED_05B = F(PROFILE, "trainer_profile_0.5b",  # the eager step over the compiled one, in one call
                 lambda r: r["step_s"] / read_result(PROFILE)["trainer_profile_0.5b_compiled"]["step_s"], fmt=num(2))
VS_TRL_05B, SHAPE_05B = "gpu/vs_trl_0.5b.json", ("policies", "Qwen2.5-0.5b shape")
LARGE_HABIT = "gpu/learning_large.json"
GRAPHS, GRAPHS_PI = "gpu/vs_trl_large_cuda_graphs.json", "gpu/vs_trl_large_cuda_graphs_trl_pi_old.json"
RUN_LABELS = {"sync": "nano-miles sync", "async": "nano-miles async S=2", "trl": "TRL"}


def dash_or(spec: str, unit: str = ""):
    return lambda v: "–" if v is None else f"{v:{spec}}{unit}"


def vs_trl_row(doc: str, policy: str, run: str, first_cell: str, *, full: bool) -> Claim:
    """A row of the TRL comparison; `full` adds the NVML and update columns of the GPU README."""
    r = ("policies", policy, "runs", run)
    figs = [F(VS_TRL, *r, "samples_per_s", fmt=grouped), F(VS_TRL, *r, "tokens_per_s", fmt=grouped),
            F(VS_TRL, *r, "step_s", fmt=num(3)), F(VS_TRL, *r, "generate_s", fmt=num(3)),
            F(VS_TRL, *r, "train_step_s", fmt=num(3)), F(VS_TRL, *r, "seconds_to_target", fmt=dash_or(".0f", " s")),
            F(VS_TRL, *r, "evals", 0, "accuracy", fmt=pct(1)), F(VS_TRL, *r, "evals", -1, "accuracy", fmt=pct(1)),
            F(VS_TRL, *r, "trainer_memory_mb", fmt=grouped)]
    cells = "{} | {} | {} | {} / {} | {} | {} → {} | {}"
    if full:
        figs += [F(VS_TRL, *r, "device_memory_mb", fmt=grouped), F(VS_TRL, *r, "update_ms", fmt=dash_or(".1f"))]
        cells += " | {} | {}"
    return C(doc, f"| {first_cell} | {cells} |", *figs)


def verdict_of(file: str, policy: str, name_start: str) -> tuple:
    """The path to the measured value of `policy`'s verdict whose name starts with `name_start`."""
    return (file, "policies", policy, "verdicts", lambda vs: next(v for v in vs if v["name"].startswith(
        f"{policy}: {name_start}"))["measured"])


def V(file: str, policy: str, name_start: str, fmt) -> Fig:
    file, *path = verdict_of(file, policy, name_start)
    return F(file, *path, fmt=fmt)


def large(file: str, run: str, key: str, fmt) -> Fig:
    return F(file, "policies", "large", "runs", run, key, fmt=fmt)


ALGORITHMS, ALGORITHMS_GPU = "algorithms.json", "gpu/algorithms_large.json"
ALGORITHM_VARIANTS = ("default", "grpo_batch", "dr_grpo", "rloo", "reinforce_pp", "grpo_loss", "gspo", "cispo",
                      "two_passes", "gspo_two_passes", "cispo_two_passes")
GPU_ALGORITHM_VARIANTS = tuple(v for v in ALGORITHM_VARIANTS if v != "reinforce_pp")  # it did not finish


def algorithm_row(variant: str) -> Claim:
    """A row of the README's table of bench/algorithms.py on the CPU: late mean, gain mean [min, max], verdict."""
    s = ("summary", variant)
    return C(README, f"| {variant} | {{}} | {{}} [{{}}, {{}}] | {{}} |",
             F(ALGORITHMS, *s, "late_mean", "mean", fmt=pct(1)), F(ALGORITHMS, *s, "gain", "mean", fmt=pct(1)),
             F(ALGORITHMS, *s, "gain", "min", fmt=pct(1)), F(ALGORITHMS, *s, "gain", "max", fmt=pct(1)),
             F(ALGORITHMS, *s, "verdict"))


def gpu_algorithm_row(variant: str) -> Claim:
    r = ("runs", {"variant": variant}, "figures")
    return C(GPU, f"| {variant} | {{}} | {{}} | {{}} |", F(ALGORITHMS_GPU, *r, "start", fmt=pct(1)),
             F(ALGORITHMS_GPU, *r, "late_mean", fmt=pct(1)), F(ALGORITHMS_GPU, *r, "gain", fmt=pct(1)))


TOOLS, TOOLS_GPU = "tools.json", "gpu/tools_large.json"


def tools_gpu_row(variant: str, label: str) -> Claim:
    """A row of bench/results/gpu/README.md's table of bench/tools.py: held-out every 8 steps, the run's time."""
    run = ("runs", {"variant": variant})
    return C(GPU, f"| {label} | {{}} | {{}} | {{}} | {{}} | {{}} | {{}} | {{}} s |",
             *(F(TOOLS_GPU, *run, "evals", i, "accuracy", fmt=pct(1)) for i in range(6)),
             F(TOOLS_GPU, *run, "wall_s", fmt=num(0)))


def tools_row(variant: str, label: str) -> Claim:
    """A row of the README's table of bench/tools.py on the CPU: start, late and gain, mean [min, max]."""
    s = ("summary", variant)
    return C(README, f"| {label} | {{}} [{{}}, {{}}] | {{}} [{{}}, {{}}] | {{}} [{{}}, {{}}] |",
             *(F(TOOLS, *s, key, stat, fmt=pct(1)) for key in ("start", "late_mean", "gain")
               for stat in ("mean", "min", "max")))


RUN = ("shapes", 0, "runs", 0)  # bench/scale.py: a shape's first run
SERVING = ("shapes", 0)  # bench/lora_serving.py: the one shape of the file


def scale_cells(file: str, *, overlapped: bool = False) -> list[Fig]:
    """A bench/scale.py run's cells as the step tables give them, in their order; an async run's
    generation is "(overlapped)" there, not a figure."""
    f, phases = f"gpu/{file}", ("step_s", "train_s") if overlapped else ("step_s", "generate_s", "train_s")
    return [*(F(f, *RUN, k, fmt=num(2)) for k in phases), F(f, *RUN, "update_ms", fmt=num(1)),
            F(f, *RUN, "train_tokens_per_s", fmt=grouped), F(f, *RUN, "mfu", fmt=pct(0)),
            *(F(f, *RUN, k, fmt=num(1)) for k in ("samples_per_s", "trainer_peak_gb", "gpu_peak_gb"))]


def scale_row(label: str, file: str) -> Claim:
    """A row of "Full fine-tune against LoRA": one bench/scale.py run; MFU counts 4 N FLOPs a token for LoRA."""
    flops = "4 N" if "LoRA" in label else "6 N"
    return C(GPU, f"| {label} | {{}} | {{}} | {{}} | {{}} | {{}} | {{}} % ({flops}) | {{}} | {{}} | {{}} |",
             *scale_cells(file))


def ratio(key: str) -> Callable[[dict, dict], float]:
    """run[key] / other[key], for `two_runs`."""
    return lambda run, other: run[key] / other[key]


def two_runs(file: str, other: str, fn: Callable[[dict, dict], float], fmt) -> Fig:
    """A figure of two bench/scale.py results' first runs side by side: fn(run of `file`, run of `other`)."""
    return F(f"gpu/{file}", *RUN, lambda run: fn(run, read_result(f"gpu/{other}")["shapes"][0]["runs"][0]), fmt=fmt)


def lora_table_cells(file: str) -> list[Fig]:
    """A run's step seconds, trainer peak and update ms, as the README's LoRA table gives them."""
    return [F(f"gpu/{file}", *RUN, k, fmt=fmt) for k, fmt in (("step_s", num(2)), ("trainer_peak_gb", num(1)),
                                                              ("update_ms", num(1)))]


def serving_rows(shape: str) -> list[Claim]:
    """The two rows of a shape in "How SGLang serves a LoRA policy"."""
    f = f"gpu/lora_serving_{shape}.json"
    merged, adapter = (*SERVING, "merged"), (*SERVING, "adapter")
    return [C(GPU, f"| {shape.upper()} | merged weights | {{}} | {{}} |", F(f, *merged, "seconds", fmt=num(2)),
              F(f, *merged, "tokens_per_s", fmt=grouped)),
            C(GPU, f"| {shape.upper()} | adapter | {{}} | {{}} | {{}} % | {{}} ({{}} of it writing the directory) |",
              F(f, *adapter, "seconds", fmt=num(2)), F(f, *adapter, "tokens_per_s", fmt=grouped),
              F(f, *SERVING, lambda e: e["adapter"]["tokens_per_s"] / e["merged"]["tokens_per_s"], fmt=pct(0)),
              F(f, *adapter, "update_ms", fmt=num(1)), F(f, *adapter, "write_ms", fmt=num(1)))]


CLAIMS = [
    tools_gpu_row("tool", "with the calculator (`rollout.fn = nano_miles.rollouts.tools:rollout`)"),
    tools_gpu_row("no_tool", "without it (one turn, no system turn)"),
    tools_row("tool", "with the calculator"),
    tools_row("no_tool", "without it"),
    C(README, "went from {} % to {} % with the calculator in 40 steps of 512 samples, and from {} % to {} % without it",
      *(F(TOOLS_GPU, "runs", {"variant": v}, "evals", i, "accuracy", fmt=pct(1)) for v in ("tool", "no_tool")
        for i in (0, -1))),
    *(algorithm_row(v) for v in ALGORITHM_VARIANTS),
    *(gpu_algorithm_row(v) for v in GPU_ALGORITHM_VARIANTS),
    # README.md, "How fast is it?" and bench/results/gpu/README.md: against TRL's GRPOTrainer
    *(vs_trl_row(README, p, run, f"{label if run == 'sync' else ''} | {RUN_LABELS[run]}", full=False)
      for p, label in (("medium", "medium (3.2 M)"), ("large", "large (39.5 M)")) for run in ("sync", "async", "trl")),
    *(vs_trl_row(GPU, p, run, f"{p} | {RUN_LABELS[run]}", full=True)
      for p in ("medium", "large") for run in ("sync", "async", "trl")),
    C(README, "(79.2 %) and plus 8 on the medium one ({} %, which no run reached",
      F(VS_TRL, "policies", "medium", "target_accuracy", fmt=pct(1))),
    C(README, "weight update per step ({} ms sync, {} ms async on the large",
      large(VS_TRL, "sync", "update_ms", num(1)), large(VS_TRL, "async", "update_ms", num(1))),
    C(README, "**Large policy: nano-miles async is ahead**, {}× TRL's samples/s and at the target in {}× its time",
      V(VS_TRL, "large", "nano-miles async S=2 samples/s", num(2)), V(VS_TRL, "large", "nano-miles' time", num(2))),
    C(README, "Sync is behind ({}×)", V(VS_TRL, "large", "nano-miles sync samples/s", num(2))),
    C(README, "Async also pays {} ms a step for the weight update", F(VS_TRL, "policies", "medium", "runs", "async",
                                                                      "update_ms", fmt=num(0))),
    C(README, "cut a sync step's wait from {} to {} s", large(VS_TRL, "sync", "generate_s", num(3)),
      large(GRAPHS, "sync", "generate_s", num(3))),
    C(README, "sync matched TRL ({}×) and async reached {}× its samples/s and the target in {}× its time",
      V(GRAPHS_PI, "large", "nano-miles sync samples/s", num(2)),
      V(GRAPHS_PI, "large", "nano-miles async S=2 samples/s", num(2)), V(GRAPHS_PI, "large", "nano-miles' time", num(2))),
    C(README, "held-out accuracy went from {} % to {} % by step {}, {} s after the run started (start-up included), "
              "and to a peak of {} % in {} steps and {} minutes, every one of {} prompts trained once",
      F(WORD_GPU, "eval_accuracy_start", fmt=pct(1)), F(WORD_GPU, "evals", 1, "accuracy", fmt=pct(1)),
      F(WORD_GPU, "evals", 1, "step"), F(WORD_GPU, "evals", 1, "elapsed_s", fmt=num(0)), F(WORD_GPU, "eval_accuracy_max", fmt=pct(1)),
      F(WORD_GPU, "num_steps"), F(WORD_GPU, "wall_s", fmt=lambda v: f"{v / 60:.1f}"),
      F(WORD_GPU, "ledger", "num_trained_once", fmt=grouped)),
    C(GPU, "async S=2 is {}× TRL's samples/s. The target was ≥ 3×: missed.",
      V(VS_TRL, "large", "nano-miles async S=2 samples/s", num(2))),
    C(GPU, "Sync is {}× and async {}× TRL's samples/s.", V(VS_TRL, "medium", "nano-miles sync samples/s", num(2)),
      V(VS_TRL, "medium", "nano-miles async S=2 samples/s", num(2))),
    C(GPU, "The sync batch wait went from {} to {} s, and sync samples/s from {} to {}.",
      large(VS_TRL, "sync", "generate_s", num(3)), large(GRAPHS, "sync", "generate_s", num(3)),
      large(VS_TRL, "sync", "samples_per_s", num(0)), large(GRAPHS, "sync", "samples_per_s", num(0))),
    C(GPU, "Async was unchanged at {} samples/s, because the trainer bounds it ({} s a step).",
      large(GRAPHS, "async", "samples_per_s", grouped), large(GRAPHS, "async", "train_step_s", num(3))),
    C(GPU, "Sync ran at {} samples/s, {}× TRL's {}.", large(GRAPHS_PI, "sync", "samples_per_s", num(0)),
      V(GRAPHS_PI, "large", "nano-miles sync samples/s", num(2)), large(GRAPHS_PI, "trl", "samples_per_s", num(0))),
    C(GPU, "Async ran at {} samples/s, {}× TRL's, with a train part of {} s a step.",
      large(GRAPHS_PI, "async", "samples_per_s", grouped), V(GRAPHS_PI, "large", "nano-miles async S=2 samples/s", num(2)),
      large(GRAPHS_PI, "async", "train_step_s", num(3))),
    C(GPU, "Held-out accuracy went from {} % to {} % by step {}, {} s after the run started",
      F(WORD_GPU, "eval_accuracy_start", fmt=pct(1)), F(WORD_GPU, "evals", 1, "accuracy", fmt=pct(1)),
      F(WORD_GPU, "evals", 1, "step"), F(WORD_GPU, "evals", 1, "elapsed_s", fmt=num(0))),
    C(GPU, "It reached a peak of {} % at step {} and ended at {} %.", F(WORD_GPU, "eval_accuracy_max", fmt=pct(1)),
      F(WORD_GPU, step_of_max), F(WORD_GPU, "eval_accuracy_end", fmt=pct(1))),
    # README.md
    C(README, "on a 2-core machine the default {} steps take about {} minutes and lift held-out accuracy from {} % "
              "to a peak of {} % (it ends at {} %; same seed, same run:",
      F("learning.json", "num_steps"), F("learning.json", "wall_s", fmt=lambda v: f"{v / 60:.0f}"),
      F("learning.json", "eval_accuracy_start", fmt=pct(0)), F("learning.json", "eval_accuracy_max", fmt=pct(1)),
      F("learning.json", "eval_accuracy_end", fmt=pct(1))),
    *(C(README, f"| {label} | {{}} % | {{}} % | {{}} points | {{}} % → {{}} % |",
        *(F("learning.json", "means", variant, key, fmt=fmt)
          for key, fmt in (("start", pct(1)), ("late_mean", pct(1)), ("gain", lambda v: f"{100 * v:+.1f}"),
                           ("first_step_start", first_step_pct), ("first_step_late", first_step_pct))))
      for label, variant in (("shipped", "shipped"), ("habit-free", "habit_free"),
                             ("control (lr 0, seed 0)", "control"))),
    C(README, "The shipped policy gains about {} points more than its habit-free twin while its first-step tags "
              "fall from {} % to {} %", F("learning.json", "means", lambda m: m["shipped"]["gain"] - m["habit_free"]["gain"],
                                         fmt=lambda v: f"{100 * v:.0f}"),
      F("learning.json", "means", "shipped", "first_step_start", fmt=pct(0)),
      F("learning.json", "means", "shipped", "first_step_late", fmt=pct(0))),
    C("nano_miles/assets/policy/README.md", "over seeds 0-2, +{} points (mean of the last three evaluations minus "
      "the start) against +{} for the same build without the habit",
      *(F("learning.json", "means", v, "gain", fmt=lambda g: f"{100 * g:.1f}") for v in ("shipped", "habit_free"))),
    *(C(GPU, f"| {label} | {seed} | {{}} % | {{}} % | {{}} points | {{}} % → {{}} % |",
        *(F(LARGE_HABIT, "runs", {"variant": variant, "seed": seed}, "figures", key, fmt=fmt)
          for key, fmt in (("start", pct(1)), ("late_mean", pct(1)), ("gain", lambda v: f"{100 * v:+.1f}"),
                           ("first_step_start", first_step_pct), ("first_step_late", first_step_pct))))
      for label, variant, seeds in (("shipped", "shipped", (0, 1, 2)), ("habit-free", "habit_free", (0, 1, 2)),
                                    ("control (lr 0)", "control", (0,))) for seed in seeds),
    *(C(README, f"| {label} | {{}} % | {{}} % | {{}} points | {{}} % → {{}} % |",
        *(F(LARGE_HABIT, "means", variant, key, fmt=fmt)
          for key, fmt in (("start", pct(1)), ("late_mean", pct(1)), ("gain", lambda v: f"{100 * v:+.1f}"),
                           ("first_step_start", first_step_pct), ("first_step_late", first_step_pct))))
      for label, variant in (("shipped recipe", "shipped"), ("habit-free (`--first-step-answer-rate 0`)", "habit_free"),
                             ("control (lr 0, seed 0)", "control"))),
    C(GPU, "The shipped build gains +{} points on average, its twin +{}: about {} points are the habit, whose "
           "tags fall from {} % to {} %",
      F(LARGE_HABIT, "means", "shipped", "gain", fmt=pct(1)), F(LARGE_HABIT, "means", "habit_free", "gain", fmt=pct(1)),
      F(LARGE_HABIT, "means", lambda m: m["shipped"]["gain"] - m["habit_free"]["gain"], fmt=pct(0)),
      F(LARGE_HABIT, "means", "shipped", "first_step_start", fmt=pct(0)),
      F(LARGE_HABIT, "means", "shipped", "first_step_late", fmt=pct(0))),
    C(GPU, "the rollout log-probs (decoded in the graphs) differ from the trainer's bf16 ones by {} (mean |Δ log p|), "
           "after the same weights through the flat transport by {}",
      F("gpu/gpu_tests_graphs.json", "parity_decode_bf16_after_update_mean_abs", fmt=num(4)),
      F("gpu/gpu_tests_graphs.json", "parity_decode_bf16_after_flat_update_mean_abs", fmt=num(4))),
    C(GPU, "The 60-step pipeline run went from {} % to {} % held-out, every prompt trained once, median in-loop "
           "flat update {} ms.",
      F("gpu/gpu_tests_graphs.json", "pipeline_summary", "eval_accuracy_start", fmt=pct_short),
      F("gpu/gpu_tests_graphs.json", "pipeline_summary", "eval_accuracy_max", fmt=pct_short),
      F("gpu/gpu_tests_graphs.json", "pipeline_update_ms_median", fmt=num(2))),
    C(README, "the rest, about +{} points, is what the same recipe gains without it",
      F("learning.json", "means", "habit_free", "gain", fmt=lambda v: f"{100 * v:.0f}")),
    C(README, "On 2 cores its {} steps take about {} minutes and lift held-out accuracy on the {} test problems "
              "from {} % to a peak of {} % (`bench/results/learning_word_problems.json`",
      F("learning_word_problems.json", "num_steps"),
      F("learning_word_problems.json", "wall_s", fmt=lambda v: f"{v / 60:.0f}"),
      F("learning_word_problems.json", "config", "task", "num_test"),
      F("learning_word_problems.json", "eval_accuracy_start", fmt=pct(1)),
      F("learning_word_problems.json", "eval_accuracy_max", fmt=pct(1))),
    C(README, "responses at the Qwen2.5-0.5B shape peaks at {} GB in bf16 with checkpointing",
      F("gpu/trainer_memory_cuda.json", "verdicts", 0, "measured", fmt=num(1))),
    C(README, "(a {} M-parameter Qwen2 shipped in", F(WS_CPU, ws_rows, {"shape": "policy"}, "num_params",
                                                    fmt=lambda v: f"{v / 1e6:.1f}")),
    C(README, "that policy, shipped: a {} M-parameter Qwen2 and its tokenizer",
      F(WS_CPU, ws_rows, {"shape": "policy"}, "num_params", fmt=lambda v: f"{v / 1e6:.1f}")),
    C(README, "--out runs/policy-medium # {} s on an H200", F(SWEEP, "rows", {"step": 450}, "warmup_s", fmt=num(0))),
    C(README, "(`nano_miles/weights/flat_sender.py`; {} ms p50 at the Qwen2.5-0.5B shape in "
              "`bench/weight_sync_gpu.py`, where SGLang's stock bucket transport took {} ms; {} ms p50 per update "
              "inside a pipeline run on that model)",
      F(WS_GPU, *FLAT, "total_ms", fmt=num(2)), F(WS_GPU, "paths", "bucket-1", "total_ms", fmt=num(2)),
      F(WS_GPU, "in_loop", "update_p50_ms", fmt=num(2))),
    C(README, "On one H200 the sync run went from {} % to {} % held-out in {} steps and {} s of training "
              "(peak {} %); async S=2 produced {}× the samples/s",
      F(LARGE_RL, "runs", 0, "summary", "eval_accuracy_start", fmt=pct(1)),
      F(LARGE_RL, "target_accuracy", fmt=pct(0)),
      F(LARGE_RL, "runs", 0, "summary", step_at(0.9)),
      F(LARGE_RL, "runs", 0, "seconds_to_target", fmt=num(0)),
      F(LARGE_RL, "runs", 0, "summary", "eval_accuracy_max", fmt=pct(0)),
      F(LARGE_RL, "speedups", 0, "speedup", fmt=num(2))),
    C(GPU, "| sync | {} | {} | {} → {} / {} % | step {}, **{} s** | {} |",
      F(LARGE_RL, "runs", 0, "train_s", fmt=num(0)), F(LARGE_RL, "runs", 0, "samples_per_s", fmt=num(0)),
      *(F(LARGE_RL, "runs", 0, "summary", k, fmt=pct(1))
        for k in ("eval_accuracy_start", "eval_accuracy_max", "eval_accuracy_end")),
      F(LARGE_RL, "runs", 0, "summary", step_at(0.9)),
      F(LARGE_RL, "runs", 0, "seconds_to_target", fmt=num(0)), F(LARGE_RL, "runs", 0, "summary", "goodput", fmt=num(3))),
    C(GPU, "| async S=2 | {} | {} (**{}×**) | {} → {} / {} % | step {}, {} s | {} |",
      F(LARGE_RL, "runs", 1, "train_s", fmt=num(0)), F(LARGE_RL, "runs", 1, "samples_per_s", fmt=num(0)),
      F(LARGE_RL, "speedups", 0, "speedup", fmt=num(2)),
      *(F(LARGE_RL, "runs", 1, "summary", k, fmt=pct(1))
        for k in ("eval_accuracy_start", "eval_accuracy_max", "eval_accuracy_end")),
      F(LARGE_RL, "runs", 1, "summary", step_at(0.9)),
      F(LARGE_RL, "runs", 1, "seconds_to_target", fmt=num(0)), F(LARGE_RL, "runs", 1, "summary", "goodput", fmt=num(3))),
    C(GPU, "| sync, 2 engines (before the fixes below) | {} | {} |", F(LARGE_RL, "runs", 2, "train_s", fmt=num(0)),
      F(LARGE_RL, "runs", 2, "samples_per_s", fmt=num(0))),
    C(GPU, "**Async S=2 is {}× sync's samples/s, and the ideal overlap bound of the sync run is {}×**",
      F(LARGE_RL, "speedups", 0, "speedup", fmt=num(2)), F(LARGE_RL, "speedups", 0, "ideal", fmt=num(2))),
    C(GPU, "| update (`update_ms`: push + telling the producer) | {} | {} |",
      F(WS_GPU, "in_loop", "update_p50_ms", fmt=num(2)), F(WS_GPU, "in_loop", "update_p90_ms", fmt=num(2))),
    C(GPU, "| push (gather {} + serialize {} + apply {}) | {} | |",
      *(F(WS_GPU, "in_loop", "split_p50_ms", k, fmt=num(2)) for k in ("gather", "serialize", "apply")),
      F(WS_GPU, "in_loop", "push_p50_ms", fmt=num(2))),
    C(GPU, "The build measured {} % greedy / {} % pass@8",
      F(LARGE, "policy_build", "held_out_greedy", fmt=pct(1)), F(LARGE, "policy_build", "held_out_pass@8", fmt=pct(1))),
    C(GPU, "- Weight updates in this run: **{} ms** p50 ({} ms pushing)",
      F(LARGE, "update_ms_p50", fmt=num(2)), F(LARGE, "push_ms_p50", fmt=num(2))),
    C(README, "on a fresh H200 the sync run's first evaluation took {} s; starting SGLang took {} s in "
              "`bench/weight_sync_gpu.py`",
      F(SYNC, "evals", 0, "elapsed_s", fmt=num(0)), F(WS_GPU, "sglang_start_s", fmt=num(0))),
    C(README, "with a {}-step warm-up; it starts at {} % held-out accuracy.",
      F(SWEEP, "rows", {"step": 450}, "step"), F(SWEEP, "rows", {"step": 450}, "greedy_accuracy", fmt=pct(0))),
    C(README, "On one H200 the sync run above reached {} % in {} steps and {} s of training",
      F(SYNC, "eval_accuracy_max", fmt=pct(0)), F(SYNC, "num_steps"), F(SYNC, training_s, fmt=num(0))),
    C(README, "two engines behind the router now serve the large policy as fast as one ({} against {} samples/s "
              "in sync; {} before a group went as one request)",
      F(ENGINES, "runs", 2, "samples_per_s", fmt=num(0)), F(ENGINES, "runs", 0, "samples_per_s", fmt=num(0)),
      F(LARGE_RL, "runs", 2, "samples_per_s", fmt=num(0))),
    # bench/results/gpu/README.md: sync/async x 1/2 engines after the router fixes
    engines_row(0, "sync", None), engines_row(1, "async S=2", 0),
    engines_row(2, "sync, 2 engines", None), engines_row(3, "async S=2, 2 engines", 1),
    C(GPU, "**Async S=2 is {}× sync on one engine and {}× on two, against ideal overlap bounds of {}× and {}×** "
           "from the sync runs' own phase times: {} % and {} % of the bound.",
      *(F(ENGINES, "speedups", k, "speedup", fmt=num(2)) for k in (0, 1)),
      *(F(ENGINES, "speedups", k, "ideal", fmt=num(2)) for k in (0, 1)),
      *(F(ENGINES, "speedups", k, "of_ideal", fmt=pct(0)) for k in (0, 1))),
    C(GPU, "**Two engines now match one** ({} against {} samples/s in sync; {} against {} before the fixes).",
      F(ENGINES, "runs", 2, "samples_per_s", fmt=num(0)), F(ENGINES, "runs", 0, "samples_per_s", fmt=num(0)),
      F(LARGE_RL, "runs", 2, "samples_per_s", fmt=num(0)), F(LARGE_RL, "runs", 0, "samples_per_s", fmt=num(0))),
    # what a weight update follows
    wakeup_row("right after the previous push (the standalone rounds)", "idle"),
    wakeup_row("after a generate batch (64 × 16 tokens)", "after_gen"),
    wakeup_row("after a generate batch, without flush", "after_gen_noflush"),
    wakeup_row("after 1 s with nothing to do", "after_sleep1"),
    wakeup_row("right after the previous push, without flush", "idle_noflush"),
    # the whole GPU suite twice
    C(GPU, "- pass 1, before sglang-router was on the host: {} (the replica tests need the router) in {} s;",
      F(SUITE2, "pass_1", "summary", fmt=suite_counts),
      F(SUITE2, "pass_1", "summary", suite_seconds, fmt=num(0))),
    C(GPU, "- pass 2, with the router: {} in {} s.", F(SUITE2, "pass_2", "summary", fmt=suite_counts),
      F(SUITE2, "pass_2", "summary", suite_seconds, fmt=num(0))),
    C(GPU, "The 60-step pipeline run went from {} % to {} % held-out (max) in pass 1 and from {} % to {} % in "
           "pass 2 (the test asks for +10 points), every update through the flat transport ({} and {} ms median).",
      *(F(SUITE2, p, "report", "pipeline_summary", k, fmt=pct_short)
        for p in ("pass_1", "pass_2") for k in ("eval_accuracy_start", "eval_accuracy_max")),
      *(F(SUITE2, p, "report", "pipeline_update_ms_median", fmt=num(2)) for p in ("pass_1", "pass_2"))),
    # bench/results/gpu/README.md: set-up and the GPU tests
    C(GPU, "on one NVIDIA H200, SGLang {}, torch {},", F(STALE, "sglang"), F(STALE, "torch")),
    C(GPU, 'tests/test_gpu.py -k "not pipeline": {}s tests/test_gpu.py -k pipeline: {}s These are the figures',
      F("gpu/gpu_tests.txt", pytest_summary("pytest.log")),
      F("gpu/gpu_tests.txt", pytest_summary("pytest_pipeline.log"))),
    C(GPU, r"mean \|Δ log p\| ({} tokens) | {} |", F(TESTS, "parity_num_tokens"),
      F(TESTS, "parity_prefill_bf16_mean_abs", fmt=num(4))),
    C(GPU, "| rollout logprobs vs trainer bf16 | {} |", F(TESTS, "parity_rollout_bf16_mean_abs", fmt=num(4))),
    C(GPU, "| engine bf16 vs trainer fp32 | {} |",
      F(TESTS, "parity_prefill_engine_bf16_vs_trainer_fp32_mean_abs", fmt=num(4))),
    C(GPU, "| parity after a CUDA-IPC update with perturbed weights | {} |",
      F(TESTS, "parity_prefill_bf16_after_update_mean_abs", fmt=num(4))),
    C(GPU, "| update of the small policy through `FlattenedTensorBucket` | {} ms |",
      F(TESTS, "policy_bucket_update_ms", fmt=num(1))),
    C(GPU, "| {}-step sync run under supervisord: held-out accuracy | {} % → {} % (max) |",
      F(TESTS, "pipeline_summary", "num_steps"), F(TESTS, "pipeline_summary", "eval_accuracy_start", fmt=pct(0)),
      F(TESTS, "pipeline_summary", "eval_accuracy_max", fmt=pct(0))),
    C(GPU, "Parity {} / {} / {} / {} (the same to two digits), bucket update of the small policy {} ms, and the "
           "{}-step run {} % → {} % held-out ({}), {} prompts trained once, {} lost, median in-loop update {} ms.",
      *(F(LAYOUT, k, fmt=num(4)) for k in ("parity_prefill_bf16_mean_abs", "parity_rollout_bf16_mean_abs",
                                            "parity_prefill_engine_bf16_vs_trainer_fp32_mean_abs",
                                            "parity_prefill_bf16_after_update_mean_abs")),
      F(LAYOUT, "policy_bucket_update_ms", fmt=num(1)), F(LAYOUT, "pipeline_summary", "num_steps"),
      F(LAYOUT, "pipeline_summary", "eval_accuracy_start", fmt=pct(0)),
      F(LAYOUT, "pipeline_summary", "eval_accuracy_max", fmt=pct_short),
      F(LAYOUT, "pipeline_summary", lambda s: "max and end" if s["eval_accuracy_max"] == s["eval_accuracy_end"]
        else f"max; {pct_short(s['eval_accuracy_end'])} % at the end"),
      F(LAYOUT, "pipeline_summary", "ledger", "num_trained_once", fmt=grouped),
      F(LAYOUT, "pipeline_summary", "ledger", "num_lost"), F(LAYOUT, "pipeline_update_ms_median", fmt=num(1))),
    # the medium policy's warm-up sweep
    sweep_row(150, "| 150 | {} | {} % | {} % |"),
    sweep_row(300, "| 300 | {} | {} % | {} % |"),
    sweep_row(450, "| **450** | {} | **{} %** | {} % |"),
    sweep_row(600, "| 600 | {} | {} % | {} % |"),
    sweep_row(900, "| 900 | {} | {} % | {} % |"),
    sweep_row(3000, "| 3000 | {} | {} % | {} % |"),
    # the sync run following the README
    C(GPU, "- {} steps × {} prompts × {} samples, lr 1e-4.", F(SYNC, "num_steps"), F(SYNC, per_step),
      F(SYNC, per_prompt)),
    C(GPU, "Held-out accuracy went from **{} % to {} %** (max, step {}) and ended at {} %. It first reached 90 % "
           "at {} of training.", F(SYNC, "eval_accuracy_start", fmt=pct(1)), F(SYNC, "eval_accuracy_max", fmt=pct(1)),
      F(SYNC, step_of_max), F(SYNC, "eval_accuracy_end", fmt=pct(1)),
      F(SYNC, first_reached(0.9), fmt=lambda v: v.replace(", ", ", after "))),
    C(GPU, "- {} prompts, each trained once; {} lost.", F(SYNC, "ledger", "num_trained_once", fmt=grouped),
      F(SYNC, "ledger", "num_lost", fmt=lambda n: "none" if n == 0 else str(n))),
    C(GPU, "- Step time {} s on average; weight update {} ms.", F(SYNC, "mean_step_s", fmt=num(2)),
      F(SYNC, "mean_update_ms", fmt=num(1))),
    C(GPU, "On that fresh host the first evaluation took {} s", F(SYNC, "evals", 0, "elapsed_s", fmt=num(0))),
    # sync vs async
    C(GPU, "- {} steps × {} × {}, lr {}. Files: `staleness.json`", F(STALE, *S, "num_steps"), F(STALE, *S, per_step),
      F(STALE, *S, per_prompt), F(STALE, override("trainer.lr"))),
    C(GPU, "The sync run came first and paid {} s of kernel compilation in its first evaluation; counting that "
           "would make async look {}× faster.", F(STALE, "runs", 0, "startup_s", fmt=num(0)),
      F(STALE, lambda r: r["runs"][0]["summary"]["wall_s"] / r["runs"][1]["summary"]["wall_s"], fmt=num(1))),
    C(GPU, "| sync | {} | {} | {} → {} / {} % | {} | {} | {} |", F(STALE, "runs", 0, "train_s", fmt=num(0)),
      F(STALE, "runs", 0, "samples_per_s", fmt=grouped), F(STALE, *S, "eval_accuracy_start", fmt=pct(1)),
      F(STALE, *S, "eval_accuracy_max", fmt=pct(1)), F(STALE, *S, "eval_accuracy_end", fmt=pct(1)),
      F(STALE, *S, first_reached(0.9, since_start=False)), F(STALE, *S, "goodput", fmt=num(3)),
      F(STALE, *S, staleness_counts)),
    C(GPU, "| async S=2 | {} | {} (**{}×**) | {} → {} / {} % | {} | {} | {} |",
      F(STALE, "runs", 1, "train_s", fmt=num(0)), F(STALE, "runs", 1, "samples_per_s", fmt=grouped),
      F(STALE, "runs", 1, "samples_per_s_ratio_to_sync", fmt=num(2)), F(STALE, *A, "eval_accuracy_start", fmt=pct(1)),
      F(STALE, *A, "eval_accuracy_max", fmt=pct(1)), F(STALE, *A, "eval_accuracy_end", fmt=pct(1)),
      F(STALE, *A, first_reached(0.9, since_start=False)), F(STALE, *A, "goodput", fmt=num(3)),
      F(STALE, *A, staleness_counts)),
    C(GPU, "An earlier pair of runs used {} steps × {} prompts × {} samples at lr {}, starting from the "
           "300-step warm-up ({} %).",
      F(B16, "runs", 0, "summary", "num_steps"), F(B16, "runs", 0, "summary", per_step),
      F(B16, "runs", 0, "summary", per_prompt), F(B16, override("trainer.lr")),
      F(B16, "runs", 0, "summary", "eval_accuracy_start", fmt=pct(0))),
    C(GPU, "when start-up was {} s because", F(B16, "runs", 0, "summary", "evals", 0, "elapsed_s", fmt=num(1))),
    C(GPU, "| sync | {} | {} / {} % |", F(B16, "runs", 0, "samples_per_s", fmt=grouped),
      F(B16, "runs", 0, "summary", "eval_accuracy_max", fmt=pct_short),
      F(B16, "runs", 0, "summary", "eval_accuracy_end", fmt=pct_short)),
    C(GPU, "| async | {} (**{}×**) | {} / {} % |", F(B16, "runs", 1, "samples_per_s", fmt=grouped),
      F(B16, "runs", 1, "samples_per_s_ratio_to_sync", fmt=num(2)),
      F(B16, "runs", 1, "summary", "eval_accuracy_max", fmt=pct_short),
      F(B16, "runs", 1, "summary", "eval_accuracy_end", fmt=pct_short)),
    C(GPU, "Both runs stalled near that policy's pass@8 ({} %)", F(SWEEP, "rows", {"step": 300}, "pass@8", fmt=pct(1))),
    C(GPU, "### Why async is {}× here", F(STALE, "runs", 1, "samples_per_s_ratio_to_sync", fmt=num(2))),
    C(GPU, "- **Sync:** {} samples/s; a step took {} s on average (evaluations included), the weight update {} ms "
           "of it.", F(STALE, "runs", 0, "samples_per_s", fmt=grouped), F(STALE, *S, "mean_step_s", fmt=num(2)),
      F(STALE, *S, "mean_update_ms", fmt=num(1))),
    C(GPU, "- **Async S=2:** {} samples/s with up to {} requests in flight, three times sync's {}.",
      F(STALE, "runs", 1, "samples_per_s", fmt=grouped),
      F(STALE, lambda r: (r["runs"][1]["summary"]["staleness_max"] + 1) * per_step(r["runs"][0]["summary"])
        * per_prompt(r["runs"][0]["summary"]), fmt=grouped),
      F(STALE, *S, lambda s: per_step(s) * per_prompt(s), fmt=grouped)),
    C(GPU, "Three times the concurrency bought {}× the samples/s",
      F(STALE, "runs", 1, "samples_per_s_ratio_to_sync", fmt=num(2))),
    C(GPU, "Each async update also costs more than a sync one, {} ms on average against {} ms.",
      F(STALE, *A, "mean_update_ms", fmt=num(1)), F(STALE, *S, "mean_update_ms", fmt=num(1))),
    # weight hot-update into SGLang
    C(GPU, "Qwen2.5-0.5B-Instruct shape: {} parameters, {} tensors, {} MB.", F(WS_GPU, "num_params", fmt=grouped),
      F(WS_GPU, "num_tensors"), F(WS_GPU, "mbytes", fmt=num(0))),
    C(GPU, "- Medians of {} rounds;", F(WS_GPU, "repeats")),
    *(update_row(p) for p in ("bucket-1", "bucket-512MiB", "flat", "one-tensor", "disk")),
    C(GPU, "p50 {} ms against a target of {} ms. That is {}× faster than SGLang's stock `FlattenedTensorBucket` "
           "transport and {}× faster than disk.", F(WS_GPU, *FLAT, "total_ms", fmt=num(2)),
      F(WS_GPU, "target_p50_ms", fmt=num(0)),
      F(WS_GPU, "paths", lambda p: p["bucket-1"]["total_ms"] / p["flat"]["total_ms"], fmt=num(1)),
      F(WS_GPU, "paths", lambda p: p["disk"]["total_ms"] / p["flat"]["total_ms"], fmt=num(0))),
    C(GPU, "Its apply ({} ms) is within {} ms of an update call that carries a single small tensor ({} ms).",
      F(WS_GPU, *FLAT, "apply_ms", fmt=num(2)),
      F(WS_GPU, "paths", lambda p: p["flat"]["apply_ms"] - p["one-tensor"]["apply_ms"],
        fmt=lambda v: f"{math.ceil(10 * v) / 10:.1f}"),
      F(WS_GPU, *ONE, "apply_ms", fmt=num(2))),
    C(GPU, "a bucket update took {}–{} ms on average in the sync runs above",
      F(STALE, *S, "mean_update_ms", fmt=num(1)),
      F(SYNC, "mean_update_ms", fmt=num(1))),
    C(GPU, "give identical engine logprobs on a probe (max |gap| {}).",
      F(WS_GPU, "max_abs_logprob_gap_between_paths", fmt=lambda v: f"{v:.1e}")),
    # full fine-tune against LoRA, one H100
    scale_row("1.5B full", "full_1.5b_h100.json"), scale_row("1.5B LoRA r16", "lora_1.5b_h100.json"),
    scale_row("3B LoRA r16", "lora_3b_h100.json"), scale_row("7B LoRA r16", "lora_7b_merged_push.json"),
    *serving_rows("1.5b"), *serving_rows("7b"),
    C(README, "| 1.5B | {} s a step, trainer peak {} GB, update {} ms | {} s, {} GB, {} ms |",
      *lora_table_cells("full_1.5b_h100.json"), *lora_table_cells("lora_1.5b_h100.json")),
    C(README, "| 3B | refused at SGLang's 0.3 (60 GiB needed, 47.7 left); at 0.13: {} s, {} GB, {} ms | {} s, {} GB, "
              "{} ms |", *lora_table_cells("full_3b_h100.json"), *lora_table_cells("lora_3b_h100.json")),
    C(README, "| 7B | does not fit: 113 GiB of weights, gradients and AdamW state alone | {} s, {} GB, {} ms |",
      *lora_table_cells("lora_7b_merged_push.json")),
    scale_row("3B full, SGLang at 0.13 (another day, above)", "full_3b_h100.json"),
    C(GPU, "| sync (one timed step) | {} | {} | {} | {} | {} | {} % | {} | {} | {} |", *scale_cells("full_3b_h100.json")),
    # the 0.5B shape again, one H100
    C(GPU, "| sync (`scale_0.5b_h100.json`) | {} | {} | {} | {} | {} | {} % | {} | {} | {} |",
      *scale_cells("scale_0.5b_h100.json")),
    C(GPU, "| sync, decoder layers compiled (`scale_0.5b_compile_h100.json`) | {} | {} | {} | {} | {} | {} % | {} | {} "
           "| {} |", *scale_cells("scale_0.5b_compile_h100.json")),
    C(GPU, "| async S=2 (`scale_0.5b_async_h100.json`) | {} | (overlapped) | {} | {} | {} | {} % | {} | {} | {} |",
      *scale_cells("scale_0.5b_async_h100.json", overlapped=True)),
    C(GPU, "SGLang alone generated the step's {} tokens at {} tokens/s; in the sync loop at {} ({} %).",
      F("gpu/scale_0.5b_h100.json", "shapes", 0, "standalone", "num_tokens", fmt=grouped),
      F("gpu/scale_0.5b_h100.json", "shapes", 0, "standalone", "tokens_per_s", fmt=grouped),
      F("gpu/scale_0.5b_h100.json", *RUN, "loop_generation_tokens_per_s", fmt=grouped),
      F("gpu/scale_0.5b_h100.json", "shapes", 0, lambda s: s["runs"][0]["loop_generation_tokens_per_s"]
        / s["standalone"]["tokens_per_s"], fmt=pct(0))),
    C(GPU, "made the train part {}× faster ({} -> {} s) and its peak {} GB smaller, but not the step: that run's "
           "generation took {} s against {} s",
      two_runs("scale_0.5b_h100.json", "scale_0.5b_compile_h100.json", ratio("train_s"), num(2)),
      F("gpu/scale_0.5b_h100.json", *RUN, "train_s", fmt=num(2)),
      F("gpu/scale_0.5b_compile_h100.json", *RUN, "train_s", fmt=num(2)),
      two_runs("scale_0.5b_h100.json", "scale_0.5b_compile_h100.json",
               lambda a, b: a["trainer_peak_gb"] - b["trainer_peak_gb"], num(1)),
      F("gpu/scale_0.5b_compile_h100.json", *RUN, "generate_s", fmt=num(2)),
      F("gpu/scale_0.5b_h100.json", *RUN, "generate_s", fmt=num(2))),
    C(README, "in one earlier pipeline run, layers only, its train part {}× faster",
      two_runs("scale_0.5b_h100.json", "scale_0.5b_compile_h100.json", ratio("train_s"), num(2))),
    C(GPU, "Async S=2 is again no faster than the sync step ({} s against {} s): its train part, beside SGLang's "
           "generation, takes {}× as long",
      F("gpu/scale_0.5b_async_h100.json", *RUN, "step_s", fmt=num(2)),
      F("gpu/scale_0.5b_h100.json", *RUN, "step_s", fmt=num(2)),
      two_runs("scale_0.5b_async_h100.json", "scale_0.5b_h100.json", ratio("train_s"), num(1))),
    C(GPU, "Where the trainer's {} s go (6 N FLOPs of these tokens take {} s at the GPU's peak)",
      F("gpu/scale_0.5b_h100.json", *RUN, "train_s", fmt=num(2)),
      F("gpu/scale_0.5b_h100.json", *RUN, lambda r: r["train_s"] * r["mfu"], fmt=num(2))),  # at MFU 1
    *(C(GPU, f"| {RUN_LABELS[run]} | {{}} | {{}} | {{}} | {{}} / {{}} | {{}} | {{}} | {{}} |",
        *(F(VS_TRL_05B, *SHAPE_05B, "runs", run, k, fmt=fmt) for k, fmt in (
            ("samples_per_s", num(1)), ("tokens_per_s", grouped), ("step_s", num(3)), ("generate_s", num(3)),
            ("train_step_s", num(3)), ("trainer_memory_mb", grouped),
            ("device_memory_mb", lambda v: grouped(v) if v else "–"), ("update_ms", dash_or(".1f")))))
      for run in ("sync", "async", "trl")),
    *(C(GPU, f"| {label} | {{}} | {{}} % | {{}} | {{}} | {{}} | {{}} | {{}} |",
        F(PROFILE, key, "step_s", fmt=num(2)), F(PROFILE, key, "mfu", fmt=pct(0)),
        F(PROFILE, key, "seconds_by_kind", matmul_s, fmt=num(2)),
        F(PROFILE, key, "seconds_by_kind", "softmax / log-probs", fmt=num(2)),
        F(PROFILE, key, "seconds_by_kind", "optimizer", fmt=num(3)),
        F(PROFILE, key, "seconds_by_kind", memory_bound_s, fmt=num(2)),
        F(PROFILE, key, "seconds_by_kind", "GPU idle (host)", fmt=num(2)))
      for label, key in (("eager", "trainer_profile_0.5b"), ("compiled", "trainer_profile_0.5b_compiled"))),
    C(GPU, "Compiling fuses half of that memory-bound work away ({} → {} s): the step is {}× faster.",
      *(F(PROFILE, key, "seconds_by_kind", memory_bound_s, fmt=num(2))
        for key in ("trainer_profile_0.5b", "trainer_profile_0.5b_compiled")),
      COMPILED_05B),
    C(GPU, "the eager step took {} s against the loop's {} s",
      F(PROFILE, "trainer_profile_0.5b", "step_s", fmt=num(2)),
      F("gpu/scale_0.5b_h100.json", *RUN, "train_s", fmt=num(2))),
    *(C(GPU, f"| {label} | {{}} | {{}} % | {{}} | {{}} | {{}} | {{}} |",
        F(f"gpu/{name}.json", "step_s", fmt=num(2)), F(f"gpu/{name}.json", "mfu", fmt=pct(0)),
        F(f"gpu/{name}.json", "seconds_by_kind", matmul_s, fmt=num(2)),
        F(f"gpu/{name}.json", "seconds_by_kind", "softmax / log-probs", fmt=num(2)),
        F(f"gpu/{name}.json", "seconds_by_kind", memory_bound_s, fmt=num(2)),
        F(f"gpu/{name}.json", "seconds_by_kind", "GPU idle (host)", fmt=num(2)))
      for label, name in (("8 k-token micro-batches, eager", "trainer_profile_1.5b_8k"),
                          ("8 k-token micro-batches, compiled", "trainer_profile_1.5b_8k_compiled"),
                          ("16 k-token micro-batches, compiled", "trainer_profile_1.5b_compiled"))),
    *(C(GPU, "| {} | {} | {} | {} | {} | {} | {} | {} |",
        F(CHUNKS, "runs", i, "settings", "logit_chunk_mib", fmt=lambda mib: "1 GiB" if mib == 1024 else f"{mib} MiB"),
        F(CHUNKS, "runs", i, "call"), F(CHUNKS, "runs", i, "step_s", fmt=num(2)),
        F(CHUNKS, "runs", i, "seconds_by_kind", compute_s, fmt=num(2)),
        F(CHUNKS, "runs", i, "seconds_by_kind", "copy / cast", fmt=num(2)),
        F(CHUNKS, "runs", i, "seconds_by_kind", "elementwise / reductions", fmt=num(2)),
        F(CHUNKS, "runs", i, "seconds_by_kind", "GPU idle (host)", fmt=num(2)),
        F(CHUNKS, "runs", i, "peak_allocated_gib", fmt=num(2))) for i in range(4)),
    C(GPU, "The kernels' time falls by {} s a step** ({} → {} s)",  # call 1; call 2 is in the table
      F(CHUNKS, "runs", lambda runs: compute_s(runs[0]["seconds_by_kind"]) - compute_s(runs[1]["seconds_by_kind"]),
        fmt=num(2)),
      *(F(CHUNKS, "runs", i, "seconds_by_kind", compute_s, fmt=num(2)) for i in (0, 1))),
    C(GPU, "Peak allocated memory rises by\n  {} GiB.",
      F(CHUNKS, "runs", lambda runs: runs[1]["peak_allocated_gib"] - runs[0]["peak_allocated_gib"], fmt=num(2))),
    C(GPU, "own matrix multiply ({} ms) and fused log-softmax ({} ms)",
      *(F(CHUNKS, "runs", 1, "top_operators", i, "ms", fmt=num(0)) for i in (3, 5))),
    C(README, "{}× faster at the 0.5B shape and {}× at 1.5B in one profile on an H100", COMPILED_05B,
      F("gpu/trainer_profile_1.5b_8k.json", lambda r: r["step_s"] / read_result(
          "gpu/trainer_profile_1.5b_8k_compiled.json")["step_s"], fmt=num(2))),
    C(README, "sync made {}× TRL's samples/s over six steps and async S=2 {}×",
      V(VS_TRL_05B, SHAPE_05B[1], "nano-miles sync", num(2)), V(VS_TRL_05B, SHAPE_05B[1], "nano-miles async", num(2))),
    C(GPU, "Over the six steps, nano-miles sync makes {}× TRL's samples/s and async S=2 {}×",
      V(VS_TRL_05B, SHAPE_05B[1], "nano-miles sync", num(2)), V(VS_TRL_05B, SHAPE_05B[1], "nano-miles async", num(2))),
    C(GPU, "both targets (≥ {}× and ≥ {}×) met.",
      *(F(VS_TRL_05B, *SHAPE_05B, "speed_targets", i, fmt=num(0)) for i in (0, 1))),
    C(GPU, "{} s a step against {} s sync on the same card, train {} s ({} tokens/s, MFU {} %) against {} s, "
           "update {} ms, {} samples/s.",
      F("gpu/full_1.5b_async_h100.json", *RUN, "step_s", fmt=num(2)),
      F("gpu/full_1.5b_h100.json", *RUN, "step_s", fmt=num(2)),
      F("gpu/full_1.5b_async_h100.json", *RUN, "train_s", fmt=num(2)),
      F("gpu/full_1.5b_async_h100.json", *RUN, "train_tokens_per_s", fmt=grouped),
      F("gpu/full_1.5b_async_h100.json", *RUN, "mfu", fmt=pct(0)),
      F("gpu/full_1.5b_h100.json", *RUN, "train_s", fmt=num(2)),
      F("gpu/full_1.5b_async_h100.json", *RUN, "update_ms", fmt=num(1)),
      F("gpu/full_1.5b_async_h100.json", *RUN, "samples_per_s", fmt=num(1))),
]


def squeeze(s: str) -> str:
    return " ".join(s.split())


def read_result(name: str):
    path = RESULTS / name
    assert path.exists(), f"{path.relative_to(REPO)} is quoted but not committed"
    if path.suffix != ".json":
        return path.read_text()
    result = json.loads(path.read_text())
    # a bench cut short leaves its finished runs marked incomplete (harness/result_file.py): not quotable,
    # unless the doc quotes them as a cut-short bench's (CUT_SHORT)
    is_cut = isinstance(result, dict) and result.get("complete") is False
    assert is_cut == (name in CUT_SHORT), f"{name}: " + ("an unfinished bench's" if is_cut else "not cut short")
    return result


def resolve(fig: Fig):
    value = read_result(fig.file)
    for step in fig.path:
        if callable(step):
            value = step(value)
        elif isinstance(step, dict):
            value = next(item for item in value if all(item[k] == wanted for k, wanted in step.items()))
        else:
            value = value[step]
    return value


def where(fig: Fig) -> str:
    steps = [getattr(s, "__name__", "<derived>") if callable(s) else str(s) for s in fig.path]
    return f"{fig.file}:{'/'.join(steps)}"


def doc_figures(doc_text: str, template: str) -> list[str] | None:
    """What the doc says in each `{}` of the template, if the text around them is still there."""
    parts = [re.escape(p) for p in squeeze(template).split("{}")]
    match = re.search(r"([^|]{1,60}?)".join(parts), doc_text)  # a figure is short and within a table cell
    return None if match is None else [g.strip() for g in match.groups()]


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: f"{Path(c.doc).parent.name or 'README'}:{c.text[:50]}")
def test_a_quoted_figure_is_what_its_result_file_holds(claim: Claim):
    values = [resolve(f) for f in claim.figs]
    expected = squeeze(claim.text.format(*(f.fmt(v) for f, v in zip(claim.figs, values))))
    doc_text = squeeze((REPO / claim.doc).read_text())
    if expected in doc_text:
        return
    said = doc_figures(doc_text, claim.text)
    if said is None:
        pytest.fail(f"{claim.doc} no longer has this text; with today's results it would read:\n  {expected}")
    wrong = [f"the doc says {s!r}; {where(f)} now holds {v!r}, i.e. {f.fmt(v)!r}"
             for f, v, s in zip(claim.figs, values, said) if squeeze(f.fmt(v)) != s]
    pytest.fail(f"{claim.doc} must be updated:\n  " + "\n  ".join(wrong) + f"\nto read:\n  {expected}")


# ---------------------------------------------------------------- sizes counted from the tree
@pytest.mark.parametrize("doc", [README, GPU])
def test_the_docs_give_the_gpu_policies_the_sizes_they_have(doc):
    from nano_miles.policy.build import build_model
    sizes = {shape: f"{sum(p.numel() for p in build_model(0, shape).parameters()) / 1e6:.1f}"
             for shape in ("medium", "large")}
    said = re.findall(r"([\d.]+) M parameters", squeeze((REPO / doc).read_text()))
    assert said and set(said) <= set(sizes.values()), f"{doc} says {said} M parameters; the policies have {sizes}"


PACKAGE = REPO / "nano_miles"
SAMPLE_PATH = ("stages", "wire", "algo", "engine/client.py", "weights/tensor_sender.py", "weights/tensor_receiver.py",
               "rollouts/__init__.py", "rollouts/engine.py", "rollouts/trajectory.py", "rollouts/single_turn.py")


def num_lines(*parts: str) -> int:
    """Physical lines of every .py file under each part of the package (a folder or one module)."""
    files = [p for part in parts for p in ([PACKAGE / part] if part.endswith(".py")
                                           else sorted((PACKAGE / part).rglob("*.py")))]
    return sum(len(p.read_text().splitlines()) for p in files)


FOLDERS = ("stages", "local_engine", "observe", "wire", "run", "weights", "engine", "policy", "tasks", "rewards",
           "algo", "rollouts")
SIZE_CLAIMS = [  # (template, [(name, counted, is_about)])
    ("The library is about {} lines of Python in {} modules, none over {} lines",
     [("lines", num_lines("."), True), ("modules", len(list(PACKAGE.rglob("*.py"))), False),
      ("module budget (tests/test_layout.py)", MAX_MODULE_LINES, False)]),
    ("Per folder: " + ", ".join(f"{f} {{}}" for f in FOLDERS) + ".", [(f, num_lines(f), True) for f in FOLDERS]),
    ("rollout and its engine adapter, wire, the engine client, algo, the tensor transport): about {} lines.",
     [(" + ".join(SAMPLE_PATH), num_lines(*SAMPLE_PATH), True)]),
]


@pytest.mark.parametrize("template, counts", SIZE_CLAIMS, ids=lambda x: x[:40] if isinstance(x, str) else "")
def test_the_readme_gives_the_library_size_the_tree_has(template, counts):
    said = doc_figures(squeeze((REPO / README).read_text()), template)
    assert said is not None, f"README.md no longer has: {template}"
    wrong = []
    for (name, counted, is_about), text in zip(counts, said):
        figure = int(text.replace(",", ""))
        slack = max(LINE_TOLERANCE * counted, 10) if is_about else 0
        if abs(figure - counted) > slack:
            wrong.append(f"{name}: the README says {text}, the tree has {counted:,}")
    assert not wrong, "README.md must be updated: " + "; ".join(wrong)
