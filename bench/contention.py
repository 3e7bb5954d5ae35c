"""Why async slows the trainer: its step alone on the GPU, then while SGLang generates beside it.

Run (one GPU, SGLang importable):
    python bench/contention.py --model DIR [--steps 3] [--out bench/results/gpu] [--name contention]
                               [--engine-env NAME=VALUE ...] [--compile] [--section.key=value ...]
    e.g. --engine.extra_args="--max-running-requests 64"; under CUDA MPS (nvidia-cuda-mps-control -d
    first) --engine-env CUDA_MPS_CLIENT_PRIORITY=1 or CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50, which reach
    SGLang only; --compile runs each decoder layer through torch.compile (dynamic shapes).

One SGLang server started as the pipeline starts it (configs/gsm8k_qwen.toml and the overrides), one
trainer in this process (the learner the trainer stage runs, its memory plan applied), one step's batch
of the config's shape: batch_groups x group_size samples, the train file's prompts, max_new_tokens
random response tokens. Timed, each after a warm-up: (1) the trainer's step alone; (2) SGLang alone on
the step's prompts; (3) both at once: SGLang generating in a loop while the trainer steps. The ratios
say what sharing the GPU costs each side; run it again with an engine or trainer setting changed to
see what that setting buys back. Writes <name>.json into --out.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.result_file import write_result  # noqa: E402
from harness.servers import REPO_ROOT  # noqa: E402
from nano_miles.run.cli import ArgumentParser, UserError, run  # noqa: E402
from nano_miles.run.config import is_override, load_config  # noqa: E402
from scale import BASE, CONFIG, step_prompts, timed_generation  # noqa: E402


def step_batch(cfg, prompts: list[list[int]]):
    """One step's samples: the first batch_groups prompts, group_size samples each, random responses."""
    import numpy as np

    from nano_miles.stages.trainer.learner import TrainSample
    rng = np.random.default_rng(0)
    n, r = cfg.rollout.group_size, cfg.rollout.max_new_tokens
    vocab = 1000  # any ids the model has; their values cost nothing
    return [TrainSample(np.asarray(p), rng.integers(3, vocab, r), np.full(r, -7.0, np.float32),
                        float(rng.integers(0, 2)), g) for g, p in enumerate(prompts) for _ in range(n)]


def time_steps(learner, batch, steps: int) -> list[float]:
    import torch
    out = []
    for _ in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        learner.step(batch)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - started)
    return out


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python bench/contention.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the model directory (harness/model_shapes.py)")
    parser.add_argument("--steps", type=int, default=3, help="timed trainer steps per part")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "gpu")
    parser.add_argument("--name", default="contention", help="the result file's name, without .json")
    parser.add_argument("--engine-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable SGLang is started with (not the trainer); repeatable")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer of the trainer")
    args, extra = parser.parse_known_args(argv)
    if bad_env := [e for e in args.engine_env if "=" not in e]:
        raise UserError(f"--engine-env takes NAME=VALUE, not {', '.join(bad_env)}")
    if bad := [a for a in extra if not is_override(a)]:
        raise UserError(f"unrecognized arguments: {' '.join(bad)}")
    import torch
    if not torch.cuda.is_available():
        raise UserError("this bench measures sharing a GPU: no CUDA device here")
    from transformers import AutoModelForCausalLM

    from harness.servers import launch, stop_sglang
    from nano_miles.engine.client import EngineClient
    from nano_miles.stages.trainer import memory_plan
    from nano_miles.stages.trainer.learner import Learner
    from nano_miles.tasks.prompts import load_tokenizer
    overrides = BASE + [f"--model.path={args.model}"] + extra
    os.environ["NANOMILES_CONFIG"] = str(REPO_ROOT / CONFIG)  # the engine reads the same config
    cfg = load_config(REPO_ROOT / CONFIG, overrides=overrides)
    if cfg.trainer.memory_plan:
        cfg = memory_plan.apply(cfg, memory_plan.plan_for(cfg, torch.cuda.get_device_properties(0).total_memory))
    tokenizer = load_tokenizer(cfg.model_dir)
    prompts = step_prompts(cfg)
    requests = [p for p in prompts for _ in range(cfg.rollout.group_size)]
    sampling = {"max_new_tokens": cfg.rollout.max_new_tokens, "temperature": cfg.rollout.temperature}
    with tempfile.TemporaryDirectory(prefix="contention-") as tmp:
        engine_env = dict(e.split("=", 1) for e in args.engine_env)
        saved = {k: os.environ.get(k) for k in engine_env}
        os.environ.update(engine_env)
        try:
            proc, url = launch(cfg.model_dir, Path(tmp) / "sglang.log", overrides, timeout_s=900, stop=stop_sglang,
                               is_new_session=True)
        finally:  # the trainer's own CUDA context starts below, without them
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
        try:
            client = EngineClient(url)
            model = AutoModelForCausalLM.from_pretrained(str(cfg.model_dir), dtype=torch.float32).to("cuda")
            if args.compile:
                for layer in model.model.layers:
                    layer.compile(dynamic=True)
            learner = Learner(cfg.trainer, model, tokenizer.pad_token_id or 0, cfg.rollout.temperature,
                              cfg.rollout.max_new_tokens)
            batch = step_batch(cfg, prompts)
            time_steps(learner, batch, 2 if args.compile else 1)  # warm-up: kernels, compiling, allocator, optimizer state
            alone = time_steps(learner, batch, args.steps)
            seconds, tokens = timed_generation(client, cfg, prompts)
            generate_alone = tokens / seconds
            stop, generated, busy = threading.Event(), [0], [0.0]

            def keep_generating():
                while not stop.is_set():
                    t0 = time.perf_counter()
                    out = client.generate(requests, sampling)
                    generated[0] += sum(o["meta_info"]["completion_tokens"] for o in out)
                    busy[0] += time.perf_counter() - t0
            thread = threading.Thread(target=keep_generating, daemon=True)
            thread.start()
            time.sleep(1.0)  # the engine's running batch fills first
            shared = time_steps(learner, batch, args.steps)
            stop.set()
            thread.join()
        finally:
            stop_sglang(proc)
    result = {"model": str(args.model), "config": CONFIG, "overrides": overrides, "engine_env": args.engine_env,
              "compile": args.compile,
              "micro_batch_tokens": cfg.trainer.micro_batch_tokens,
              "gradient_checkpointing": cfg.trainer.gradient_checkpointing,
              "train_step_s_alone": alone, "train_step_s_shared": shared,
              "generate_tokens_per_s_alone": generate_alone,
              "generate_tokens_per_s_shared": generated[0] / busy[0] if busy[0] else None}
    slowdown = statistics.median(shared) / statistics.median(alone)
    print(f"\n{'':<22} {'alone':>10} {'shared':>10} {'ratio':>6}\n"
          f"{'trainer step s':<22} {statistics.median(alone):>10.2f} {statistics.median(shared):>10.2f} "
          f"{slowdown:>6.2f}")
    if result["generate_tokens_per_s_shared"]:
        print(f"{'SGLang tokens/s':<22} {generate_alone:>10,.0f} {result['generate_tokens_per_s_shared']:>10,.0f} "
              f"{result['generate_tokens_per_s_shared'] / generate_alone:>6.2f}")
    write_result(args.out / f"{args.name}.json", result, is_complete=True)
    return 0


if __name__ == "__main__":
    run(main, "contention")
