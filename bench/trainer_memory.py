"""Peak memory and training speed of one optimizer step, against response length, micro-batch budget,
precision and activation checkpointing.

Run: python bench/trainer_memory.py [--device cpu|cuda] [--quick] [--out bench/results]

Each configuration takes one warm-up step and one measured step of the trainer's `Learner` (AdamW,
the GRPO loss, chunked log-probs) on random token samples (150-token prompts on the GPU, 20 on the
CPU) with random advantages:

* cpu: the shipped small policy, each configuration in a fresh process, since the peak RSS that the
  trainer reports on a CPU only ever grows within one process.
* cuda: a random-init model of the Qwen2.5-0.5B shape (no download), in fp32 master weights; peak
  memory is CUDA's max allocated during the measured step, AdamW state included. One row
  ("unchunked") scores all response tokens in one piece, as the trainer did before chunked
  log-probs, to show what chunking saves.

Columns: peak MB, step seconds, training tokens/s (prompt + response tokens through forward and
backward) and, on a GPU, model FLOPs utilisation against the dtype's dense peak (model FLOPs: 6 per
parameter per token, the output head on response tokens only, causal attention; recomputation by
checkpointing not counted). Targets on the H200: the 256-sample step with 512-token responses at
the 0.5B shape in at most 40 GB peak, and MFU of at least 25 % in bf16. Writes
trainer_memory_<device>.json under --out (bench/results/gpu for cuda), after every configuration
(`"complete": false`, the rows so far) and again at the end with the verdicts, so a bench cut short
keeps the rows it finished.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.model_shapes import QWEN25_05B  # noqa: E402
from harness.result_file import write_result  # noqa: E402
from harness.verdict import Verdict, print_verdicts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_GB, TARGET_MFU = 40.0, 25.0
# dense peak FLOP/s by (GPU name part, dtype): the H200 has the H100 SXM's compute
PEAK_FLOPS = {("H200", "bfloat16"): 989e12, ("H200", "float32"): 67e12,
              ("H100", "bfloat16"): 989e12, ("H100", "float32"): 67e12}


@dataclass(frozen=True)
class Case:
    samples: int
    prompt: int
    response: int
    budget: int            # trainer.micro_batch_tokens; 0 = the whole batch at once
    dtype: str             # trainer.dtype
    checkpointing: bool    # trainer.gradient_checkpointing
    chunked: bool = True   # False: all response tokens' logits at once, as before chunked log-probs

    @property
    def label(self) -> str:
        return (f"{self.samples}x({self.prompt}+{self.response}) budget {self.budget or 'whole'} {self.dtype}"
                + (" ckpt" if self.checkpointing else "") + ("" if self.chunked else " unchunked"))


def cpu_cases(quick: bool) -> list[Case]:
    lengths = (128, 512) if quick else (128, 512, 2048)
    cases = []
    for r in lengths:
        cases += [Case(32, 20, r, 0, "float32", False), Case(32, 20, r, 4096, "float32", False),
                  Case(32, 20, r, 4096, "float32", True), Case(32, 20, r, 4096, "bfloat16", True)]
    return cases


def gpu_cases(quick: bool) -> list[Case]:
    lengths = (512,) if quick else (128, 512, 2048)
    cases = [Case(16, 150, 512, 0, "float32", False, chunked=False), Case(16, 150, 512, 0, "float32", False)]
    for r in lengths:
        cases += [Case(64, 150, r, 0, "float32", False), Case(64, 150, r, 16384, "float32", False),
                  Case(64, 150, r, 16384, "bfloat16", False), Case(64, 150, r, 16384, "bfloat16", True),
                  Case(64, 150, r, 65536, "bfloat16", True)]
    return cases + [Case(256, 150, 512, 16384, "bfloat16", True), Case(256, 150, 512, 65536, "bfloat16", True)]


def make_model(device: str, shape: dict = QWEN25_05B):
    """The shipped small policy on the CPU; on a GPU a random-init model of `shape` (harness/model_shapes.py)
    in fp32 master weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from nano_miles.run.config import DEFAULT_POLICY_DIR
    torch.manual_seed(0)
    if device == "cpu":  # positions beyond the 256 it was trained on: only memory and time are measured
        config = AutoConfig.from_pretrained(DEFAULT_POLICY_DIR, max_position_embeddings=4096)
        return AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY_DIR, config=config, dtype=torch.float32)
    with torch.device(device):
        return Qwen2ForCausalLM(Qwen2Config(**shape)).float()


def random_samples(num: int, prompt: int, response: int, vocab: int) -> list:
    """`num` trainer samples of random tokens (seed 0), in groups of 8, with random rewards."""
    import numpy as np

    from nano_miles.stages.trainer.learner import TrainSample
    rng = np.random.default_rng(0)
    return [TrainSample(rng.integers(3, vocab, prompt), rng.integers(3, vocab, response),
                        np.full(response, -5.0, np.float32), float(rng.standard_normal()), i // 8) for i in range(num)]


def model_flops(model, case: Case) -> float:
    """Forward + backward FLOPs of the step's model math (3x the forward's)."""
    cfg = model.config
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    seq = case.prompt + case.response - 1
    forward = case.samples * (2 * body * seq + 2 * cfg.hidden_size * cfg.vocab_size * case.response
                              + 2 * cfg.num_hidden_layers * cfg.hidden_size * seq * seq)  # QK^T and AV, causal
    return 3 * forward


def measure(case: Case, device: str) -> dict:
    import torch

    from nano_miles.algo import grpo
    from nano_miles.run.sections import TrainerConfig
    from nano_miles.stages.trainer.learner import Learner
    torch.set_num_threads(1)  # the trainer's default trainer.num_threads
    model = make_model(device)
    samples = random_samples(case.samples, case.prompt, case.response, model.config.vocab_size)
    cfg = TrainerConfig(lr=1e-6, micro_batch_tokens=case.budget, dtype=case.dtype,
                        gradient_checkpointing=case.checkpointing)
    row = {**asdict(case), "label": case.label}
    chunk_elements = grpo.LOGIT_CHUNK_ELEMENTS
    if not case.chunked:  # one chunk: every response token's logits at once
        grpo.LOGIT_CHUNK_ELEMENTS = 1 << 62
    try:
        learner = Learner(cfg, model, pad_id=0, temperature=1.0)
        learner.step(samples)  # warm-up: kernels, allocator, AdamW state
        if device != "cpu":
            torch.cuda.synchronize()
        started = time.perf_counter()
        result, _ = learner.step(samples)
        if device != "cpu":
            torch.cuda.synchronize()
        step_s = time.perf_counter() - started
    except torch.OutOfMemoryError:
        return {**row, "oom": True}
    finally:  # the GPU cases share one process
        grpo.LOGIT_CHUNK_ELEMENTS = chunk_elements
    row.update(oom=False, peak_mb=result.peak_memory_mb, step_s=step_s, num_micro_batches=result.num_micro_batches,
               train_tokens_per_s=case.samples * (case.prompt + case.response - 1) / step_s)
    if device != "cpu":
        name = torch.cuda.get_device_name()
        peak = next((v for (gpu, dtype), v in PEAK_FLOPS.items() if gpu in name and dtype == case.dtype), None)
        row["mfu_percent"] = None if peak is None else 100 * model_flops(model, case) / step_s / peak
    return row


def run_cpu_case(case: Case) -> dict:
    """One configuration in a fresh process (peak RSS is per process)."""
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps(asdict(case))], capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{case.label} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_table(rows: list[dict]) -> None:
    print(f"\n{'configuration':<52} {'peak MB':>9} {'step s':>8} {'tokens/s':>10} {'micro':>6} {'MFU %':>6}")
    for r in rows:
        if r["oom"]:
            print(f"{r['label']:<52} {'OOM':>9}")
            continue
        mfu = r.get("mfu_percent")
        print(f"{r['label']:<52} {r['peak_mb']:>9.0f} {r['step_s']:>8.2f} {r['train_tokens_per_s']:>10.0f} "
              f"{r['num_micro_batches']:>6} {'' if mfu is None else f'{mfu:.1f}':>6}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python bench/trainer_memory.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="fewer response lengths")
    parser.add_argument("--out", type=Path, default=None, help="result directory (default bench/results[/gpu])")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one CPU case, print its JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(Case(**json.loads(args.one)), "cpu")))
        return 0
    path = (args.out or (RESULTS / "gpu" if args.device == "cuda" else RESULTS)) / f"trainer_memory_{args.device}.json"
    rows = []
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("--device cuda: torch sees no CUDA device here", file=sys.stderr)
            return 2
        gpu = torch.cuda.get_device_name()
        for case in gpu_cases(args.quick):
            rows.append(measure(case, "cuda"))
            write_result(path, {"device": args.device, "gpu": gpu, "rows": rows}, is_complete=False)
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    else:
        gpu = None
        for case in cpu_cases(args.quick):
            rows.append(run_cpu_case(case))
            write_result(path, {"device": args.device, "gpu": gpu, "rows": rows}, is_complete=False)
            peak = "OOM" if rows[-1]["oom"] else f"{rows[-1]['peak_mb']:.0f} MB, {rows[-1]['step_s']:.1f} s"
            print(f"{case.label}: {peak}", flush=True)
    print_table(rows)
    verdicts = []
    if args.device == "cuda":
        target = [r for r in rows if r["samples"] == 256 and r["response"] == 512 and not r["oom"]]
        best = min(target, key=lambda r: r["peak_mb"]) if target else None
        verdicts.append(Verdict("256 x 512-token step at the 0.5B shape, peak", best and best["peak_mb"] * 2**20 / 1e9,
                                "<=", TARGET_GB, "GB", why_none="out of memory"))
        mfus = [r["mfu_percent"] for r in rows if not r["oom"] and r["dtype"] == "bfloat16" and r.get("mfu_percent")]
        verdicts.append(Verdict("best bf16 MFU of the training step", max(mfus) if mfus else None, ">=", TARGET_MFU,
                                "%", why_none="not measured"))
        print_verdicts(verdicts)
    write_result(path, {"device": args.device, "gpu": gpu, "rows": rows, "verdicts": [v.to_json() for v in verdicts]},
                 is_complete=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
