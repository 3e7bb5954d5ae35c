"""Real model sizes on one GPU or several: the whole pipeline, sync and async, at Qwen2.5's shapes (random weights).

Run (one GPU, SGLang importable; each shape's model directory is built on the first run):
    python bench/scale.py --shapes 0.5b,1.5b,3b [--modes sync,async] [--steps 8] [--models runs/shapes]
                          [--out bench/results/gpu] [--name scale] [--section.key=value ...]
    python bench/scale.py --report bench/results/gpu/scale.json      (print a table again)

Per shape: a model directory of random weights with the project's tokenizer (harness/model_shapes.py),
then SGLang alone on one step's batch (the same server command, prompts and sampling as the
pipeline's, sent as one batch: what the engine can do with no pipeline around it), then the real
pipeline under supervisord (configs/gsm8k_qwen.toml on the word-problem file: 16 prompts x 8 samples x
512 new tokens a step, bf16) in each mode. A random model never samples a stop id, so every response
runs to max_new_tokens: a fixed-length benchmark. Nothing it learns means anything.

Per run, medians over steps 2..N-1 (step 1 pays first-time costs, the last one evaluates): seconds a step and its split (generate,
score + waiting, train, update), generation tokens/s in the loop (sync: the step's response tokens over
its generate phase) against SGLang alone, the trainer's tokens/s and MFU (6 x parameters x tokens through
forward and backward, 4 x for LoRA's frozen base, against the GPU's dense bf16 peak), the weight update, samples/s, the trainer's
peak memory and all the GPUs' together (NVML, every process). Writes <name>.json into --out.

Several GPUs are the same bench with the layout's keys (docs/scale-out.md), e.g.
    --engine.colocate=false --engine.weight_transport=distributed --engine.weight_group_backend=nccl
        --engine.mem_fraction_static=0.8 --name disaggregated    (trainer on GPU 0, SGLang on GPU 1)
    --engine.colocate=false --engine.replicas=2 --modes sync       (two engines behind the router)
    --trainer.strategy=fsdp2 --trainer.world_size=2                (a 2-rank trainer, engines beside it)
"SGLang alone" is always one engine, started as the pipeline's engine 0 is.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.model_shapes import SHAPES, built, num_parameters  # noqa: E402
from harness.result_file import write_result  # noqa: E402
from harness.servers import REPO_ROOT  # noqa: E402
from nano_miles.run.cli import ArgumentParser, UserError, run  # noqa: E402
from nano_miles.run.config import is_override, load_config  # noqa: E402

CONFIG = "configs/gsm8k_qwen.toml"
# the held-out evaluations (before step 1 and with the last step) time nothing here and a random model
# scores 0 on them: 4 problems keep them to a few seconds of a run on a device's limited time
BASE = ["--task.train_file=examples/word_problems/train.jsonl", "--task.test_file=examples/word_problems/test.jsonl",
        "--task.num_test=4", "--trainer.eval_every=0", "--trainer.checkpoint_every=0"]
MODES = {"sync": ["--run.mode=sync", "--run.max_staleness=0"], "async": ["--run.mode=async", "--run.max_staleness=2"]}
PEAK_BF16_FLOPS = 989e12  # an H100/H200's dense bf16 peak (the figure MFU is quoted against)


def gpu_name() -> str:
    """The GPU the bench runs on, for its result file; a UserError where torch sees none."""
    import torch
    if not torch.cuda.is_available():
        raise UserError(f"this bench runs SGLang and the trainer on a GPU; torch {torch.__version__} sees none here")
    return torch.cuda.get_device_name()


def step_prompts(cfg) -> list[list[int]]:
    """One step's prompts as the producer encodes them: the first batch_groups problems of the train file."""
    from nano_miles.tasks import load_problems
    from nano_miles.tasks.prompts import encode_prompts, load_tokenizer
    return encode_prompts(load_tokenizer(cfg.model_dir), load_problems(cfg, "train"), cfg.task)[:cfg.trainer.batch_groups]


def timed_generation(client, cfg, prompts: list[list[int]]) -> tuple[float, int]:
    """(seconds, tokens) of one request of every prompt x group_size samples, after a warm-up of a quarter."""
    batch = [p for p in prompts for _ in range(cfg.rollout.group_size)]
    sampling = {"max_new_tokens": cfg.rollout.max_new_tokens, "temperature": cfg.rollout.temperature}
    client.generate(batch[:max(1, len(batch) // 4)], sampling)
    started = time.perf_counter()
    out = client.generate(batch, sampling)
    return time.perf_counter() - started, sum(o["meta_info"]["completion_tokens"] for o in out)


def standalone_generation(cfg, overrides: list[str], log: Path) -> dict:
    """SGLang alone on one step's batch: started as the pipeline starts it, sent the step's prompts
    (batch_groups problems x group_size) in one request, timed after a warm-up batch."""
    from harness.servers import launch, stop_sglang
    from nano_miles.engine.client import EngineClient
    prompts = step_prompts(cfg)
    proc, url = launch(cfg.model_dir, log, overrides, timeout_s=900, stop=stop_sglang, is_new_session=True)
    try:
        seconds, tokens = timed_generation(EngineClient(url), cfg, prompts)
    finally:
        stop_sglang(proc)
    return {"seconds": seconds, "num_tokens": tokens, "tokens_per_s": tokens / seconds}


def pipeline_run(mode: str, overrides: list[str], root: Path, flops_per_token: float, logs: Path | None) -> dict:
    from staleness import run_dir_name, run_variant
    from vs_trl import DeviceMemory

    from nano_miles.observe.run_record import read_jsonl
    with DeviceMemory() as memory:
        try:
            run_variant(mode, 0, MODES[mode] + overrides, root)
        finally:
            if logs is not None:
                logs.mkdir(parents=True, exist_ok=True)
                for log in (root / run_dir_name(mode, 0)).glob("*.log"):
                    shutil.copy(log, logs / f"{mode}_{log.name}")
    # step 1 pays first-time costs; a step that ran the held-out evaluation (the last one) is no step's pace
    records = [r for r in read_jsonl(root / run_dir_name(mode, 0) / "metrics.jsonl")[1:] if not r["phase_s"]["eval"]]
    median = lambda key: statistics.median(r[key] for r in records)  # noqa: E731
    phase = lambda *names: statistics.median(sum(r["phase_s"][n] for n in names) for r in records)  # noqa: E731
    train_tokens_per_s = median("train_tokens_per_s")
    generate_s = phase("generate")
    return {"mode": mode, "num_timed_steps": len(records), "step_s": median("step_s"),
            "generate_s": generate_s, "score_wait_s": phase("score", "waiting"), "train_s": phase("train"),
            "update_ms": median("update_ms"),
            "loop_generation_tokens_per_s": (median("num_tokens") / generate_s) if mode == "sync" and generate_s else None,
            "train_tokens_per_s": train_tokens_per_s,
            "mfu": flops_per_token * train_tokens_per_s / PEAK_BF16_FLOPS,
            "samples_per_s": statistics.median(r["num_samples"] / r["step_s"] for r in records),
            "trainer_peak_gb": max(r["peak_memory_mb"] for r in records) / 1024,
            "gpu_peak_gb": None if memory.peak_mb is None else memory.peak_mb / 1024}


def print_table(shapes: list[dict]) -> None:
    print(f"\n{'shape':<6} {'run':<11} {'s/step':>6} {'gen s':>6} {'wait s':>6} {'train s':>7} {'upd ms':>6} "
          f"{'gen tok/s':>9} {'of alone':>8} {'train tok/s':>11} {'MFU':>5} {'samples/s':>9} "
          f"{'trainer GB':>10} {'GPU GB':>6}")
    for s in shapes:
        alone = s.get("standalone")  # None: --skip-alone
        if alone is not None:
            print(f"{s['shape']:<6} {'SGLang alone':<11} {'':>6} {alone['seconds']:>6.2f} {'':>6} {'':>7} {'':>6} "
                  f"{alone['tokens_per_s']:>9,.0f}")
        for r in s["runs"]:
            gen = r["loop_generation_tokens_per_s"]
            print(f"{s['shape']:<6} {r['mode']:<11} {r['step_s']:>6.2f} {r['generate_s']:>6.2f} {r['score_wait_s']:>6.2f} "
                  f"{r['train_s']:>7.2f} {r['update_ms']:>6.1f} {'-' if gen is None else format(gen, ',.0f'):>9} "
                  f"{'-' if gen is None or alone is None else format(gen / alone['tokens_per_s'], '.0%'):>8} "
                  f"{r['train_tokens_per_s']:>11,.0f} {r['mfu']:>5.0%} {r['samples_per_s']:>9.1f} "
                  f"{r['trainer_peak_gb']:>10.1f} {'-' if r['gpu_peak_gb'] is None else format(r['gpu_peak_gb'], '.1f'):>6}")


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python bench/scale.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="0.5b,1.5b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--modes", default="sync,async", help="comma-separated, of sync, async")
    parser.add_argument("--steps", type=int, default=8, help="pipeline steps per run (the first is not timed)")
    parser.add_argument("--models", type=Path, default=REPO_ROOT / "runs" / "shapes",
                        help="where the shapes' model directories are (built there if missing)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "gpu")
    parser.add_argument("--name", default="scale", help="the result file's name, without .json")
    parser.add_argument("--keep-logs", action="store_true",
                        help="copy each run's engine and trainer logs to --out/<name>_logs (SGLang's decode lines)")
    parser.add_argument("--skip-alone", action="store_true",
                        help="no SGLang-alone run (a comparison of trainer settings needs none): saves an engine start")
    parser.add_argument("--report", type=Path, help="print the table of an earlier result file and stop")
    args, extra = parser.parse_known_args(argv)
    if args.report is not None:
        print_table(json.loads(args.report.read_text())["shapes"])
        return 0
    shapes, modes = args.shapes.split(","), args.modes.split(",")
    if unknown := [s for s in shapes if s not in SHAPES] + [m for m in modes if m not in MODES]:
        raise UserError(f"unknown shape or mode: {', '.join(unknown)}")
    if bad := [a for a in extra if not is_override(a)]:
        raise UserError(f"unrecognized arguments: {' '.join(bad)}")
    if args.steps < 2:
        raise UserError("--steps must be at least 2: the first step is not timed")
    os.environ["NANOMILES_CONFIG"] = str(REPO_ROOT / CONFIG)
    result = {"gpu": gpu_name(), "config": CONFIG, "overrides": BASE + extra, "steps": args.steps,
              "shapes": []}
    for shape in shapes:
        model_dir = built(shape, args.models / shape)
        overrides = BASE + [f"--model.path={model_dir}", f"--trainer.num_steps={args.steps}"] + extra
        cfg = load_config(REPO_ROOT / CONFIG, overrides=overrides)
        entry = {"shape": shape, "num_parameters": num_parameters(SHAPES[shape]), "runs": []}
        # forward 2 N a token, backward 4 N; frozen weights (LoRA) need no weight gradients: 2 N of it
        entry["flops_per_token"] = (4 if cfg.trainer.lora_rank else 6) * entry["num_parameters"]
        result["shapes"].append(entry)
        with tempfile.TemporaryDirectory(prefix=f"scale-{shape}-") as tmp:
            if not args.skip_alone:
                print(f"{shape}: SGLang alone on one step's batch ...", flush=True)
                entry["standalone"] = standalone_generation(cfg, overrides, Path(tmp) / "sglang.log")
            for mode in modes:
                logs = args.out / f"{args.name}_logs" / shape if args.keep_logs else None
                entry["runs"].append(pipeline_run(mode, overrides, Path(tmp), entry["flops_per_token"], logs))
                write_result(args.out / f"{args.name}.json", result, is_complete=False)  # a cut bench keeps its runs
                print_table([entry])
    write_result(args.out / f"{args.name}.json", result, is_complete=True)
    print_table(result["shapes"])
    return 0


if __name__ == "__main__":
    run(main, "scale")
