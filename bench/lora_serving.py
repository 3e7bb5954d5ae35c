"""How SGLang should serve a LoRA policy: merged weights (what the trainer pushes) or the adapter itself.

Run (one GPU, SGLang importable; the shapes' model directories are bench/scale.py's, built if missing):
    python bench/lora_serving.py --shapes 1.5b,7b [--rank 16] [--updates 5] [--models runs/shapes]
                                 [--out bench/results/gpu] [--name lora_serving] [--keep-logs]

Per shape, on bench/scale.py's step batch (16 prompts x 8 samples x 512 new tokens, the pipeline's
server command and sampling):
  merged   SGLang as the pipeline starts it: the weights it serves are plain, so its kernels and CUDA graphs
           are the base model's. The trainer's side of this path, the merged push, is the pipeline's
           `update ms` (bench/scale.py --trainer.lora_rank=R).
  adapter  the same server with --enable-lora --max-lora-rank R --lora-target-modules all, serving an
           adapter of rank R (the trainer's own `lora.wrap`, B drawn at random so the adapter is not a
           no-op) by name. One update of this path = the trainer writes PEFT's adapter directory, the
           engine unloads the old adapter and loads the new one (/unload_lora_adapter, /load_lora_adapter);
           its median over --updates.
Both generation rates are timed as bench/scale.py times SGLang alone (one request, after a warm-up).
Writes <name>.json into --out; --keep-logs copies both servers' logs to --out/<name>_logs/<shape>.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.model_shapes import SHAPES, built  # noqa: E402
from harness.result_file import write_result  # noqa: E402
from harness.servers import REPO_ROOT  # noqa: E402
from nano_miles.engine.client import EngineClient  # noqa: E402
from nano_miles.run.cli import ArgumentParser, UserError, run  # noqa: E402
from nano_miles.run.config import load_config  # noqa: E402

ADAPTER = "policy"  # the name the engine serves the adapter under


class AdapterClient(EngineClient):
    """An `EngineClient` whose requests are all served through the adapter, and which swaps it."""

    def generate(self, batch: list[list[int]], sampling: dict) -> list[dict]:
        return self._call("POST", "/generate", {"input_ids": batch, "sampling_params": sampling, "lora_path": ADAPTER})

    def load_adapter(self, directory: Path) -> None:
        loaded = self._call("POST", "/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": str(directory)})
        if not loaded.get("success", False):
            raise RuntimeError(f"the engine refused the adapter: {loaded.get('error_message')}")

    def unload_adapter(self) -> None:
        self._call("POST", "/unload_lora_adapter", {"lora_name": ADAPTER})


def adapted_model(model_dir: Path, rank: int):
    """The trainer's LoRA model of `model_dir` on the GPU, bf16 base, B drawn at random (PEFT's B = 0
    would make the adapter a no-op that an engine could skip)."""
    import torch
    from transformers import AutoModelForCausalLM

    from nano_miles.run.sections import TrainerConfig
    from nano_miles.stages.trainer import lora
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    model = lora.wrap(base, TrainerConfig(lora_rank=rank, dtype="bfloat16"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.01)
    return model.to("cuda")


def swap_adapter(client, model, directory: Path) -> dict:
    """One update of the adapter path: write the adapter directory, unload the served one, load it again."""
    started = time.perf_counter()
    model.save_pretrained(directory)
    written = time.perf_counter()
    client.unload_adapter()
    client.load_adapter(directory)
    return {"write_ms": (written - started) * 1e3, "total_ms": (time.perf_counter() - started) * 1e3}


def measure_shape(out: dict, model_dir: Path, rank: int, num_updates: int, root: Path) -> None:
    """Fills `out` as it goes: a shape whose adapter server fails keeps its merged figures."""
    from scale import BASE, CONFIG, standalone_generation, step_prompts, timed_generation

    from harness.servers import launch, stop_sglang
    overrides = BASE + [f"--model.path={model_dir}"]
    cfg = load_config(REPO_ROOT / CONFIG, overrides=overrides)
    print(f"{out['shape']}: merged weights (the plain server) ...", flush=True)
    out["merged"] = standalone_generation(cfg, overrides, root / "merged.log")
    print(f"{out['shape']}: the adapter served by SGLang's LoRA kernels ...", flush=True)
    model = adapted_model(model_dir, rank)
    lora_args = f"{cfg.engine.extra_args} --enable-lora --max-lora-rank {rank} --lora-target-modules all"
    proc, url = launch(model_dir, root / "adapter.log", overrides + [f"--engine.extra_args='{lora_args}'"],
                       timeout_s=900, stop=stop_sglang, is_new_session=True)
    try:
        client = AdapterClient(url)
        model.save_pretrained(root / "adapter")
        client.load_adapter(root / "adapter")
        updates = [swap_adapter(client, model, root / "adapter") for _ in range(num_updates)]
        seconds, tokens = timed_generation(client, cfg, step_prompts(cfg))
    finally:
        stop_sglang(proc)
    out["adapter"] = {"seconds": seconds, "num_tokens": tokens, "tokens_per_s": tokens / seconds,
                      "update_ms": statistics.median(u["total_ms"] for u in updates),
                      "write_ms": statistics.median(u["write_ms"] for u in updates)}


def print_table(shapes: list[dict]) -> None:
    print(f"\n{'shape':<6} {'served as':<9} {'gen s':>6} {'tokens/s':>9} {'of merged':>9} {'update ms':>9} "
          f"{'(write ms)':>10}")
    for s in shapes:
        merged, adapter = s["merged"], s.get("adapter")
        print(f"{s['shape']:<6} {'merged':<9} {merged['seconds']:>6.2f} {merged['tokens_per_s']:>9,.0f} {'':>9} "
              f"{'(push)':>9}")
        if adapter is not None:
            print(f"{s['shape']:<6} {'adapter':<9} {adapter['seconds']:>6.2f} {adapter['tokens_per_s']:>9,.0f} "
                  f"{adapter['tokens_per_s'] / merged['tokens_per_s']:>9.0%} {adapter['update_ms']:>9.1f} "
                  f"{adapter['write_ms']:>10.1f}")


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python bench/lora_serving.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1.5b,7b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--rank", type=int, default=16, help="the adapter's rank (trainer.lora_rank)")
    parser.add_argument("--updates", type=int, default=5, help="adapter swaps timed per shape (median)")
    parser.add_argument("--models", type=Path, default=REPO_ROOT / "runs" / "shapes",
                        help="where the shapes' model directories are (built there if missing)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "gpu")
    parser.add_argument("--name", default="lora_serving", help="the result file's name, without .json")
    parser.add_argument("--keep-logs", action="store_true",
                        help="copy both servers' logs to --out/<name>_logs/<shape> (SGLang's start and decode lines)")
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        raise UserError(f"unknown shape: {', '.join(unknown)}")
    if args.rank < 1 or args.updates < 1:
        raise UserError("--rank and --updates must be at least 1")
    from scale import CONFIG, gpu_name
    os.environ["NANOMILES_CONFIG"] = str(REPO_ROOT / CONFIG)  # the config the servers' launcher reads
    result = {"gpu": gpu_name(), "shapes": []}
    for shape in shapes:
        entry = {"shape": shape, "rank": args.rank}
        result["shapes"].append(entry)
        with tempfile.TemporaryDirectory(prefix=f"lora-serving-{shape}-") as tmp:
            try:
                measure_shape(entry, built(shape, args.models / shape), args.rank, args.updates, Path(tmp))
            finally:
                # a cut or failed bench keeps what it measured, and the servers' logs say why
                write_result(args.out / f"{args.name}.json", result, is_complete=False)
                if args.keep_logs:
                    logs = args.out / f"{args.name}_logs" / shape
                    logs.mkdir(parents=True, exist_ok=True)
                    for log in Path(tmp).glob("*.log"):
                        shutil.copy(log, logs / log.name)
        print_table(result["shapes"][-1:])
    write_result(args.out / f"{args.name}.json", result, is_complete=True)
    print_table(result["shapes"])
    return 0


if __name__ == "__main__":
    run(main, "lora_serving")
