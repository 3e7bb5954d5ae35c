"""Where one optimizer step of the trainer spends its time: one `Learner` step under torch.profiler.

Run: python bench/trainer_profile.py [--device cpu|cuda] [--shape 0.5b] [--samples 128] [--prompt 150]
                                     [--response 512] [--micro-batch-tokens 16384] [--checkpointing]
                                     [--compile] [--logit-chunk-mib 1024] [--top 15] [--out DIR]

The trainer's step of the scale bench, alone: random token samples (fixed-length responses, as a
random-weight model writes them) through the Learner the trainer stage runs, with its GPU settings
(bf16 autocast, packed micro-batches, fused AdamW). After two warm-up steps (kernels, the allocator,
AdamW state; the compile with --compile), one step runs under torch.profiler. On a GPU the step's kernel
time is summed by kind (matrix multiplies, attention, the log-probs' softmax, the optimizer, copies and
casts, the rest: elementwise ops and reductions), against the step's wall time; what the kernels leave of
it is time the GPU waited for the host (kernel launches, synchronisation, Python). MFU counts 6 N FLOPs
a token, as bench/scale.py does, and the peak of allocated memory is taken over every step run. On the
CPU the small policy's step is split by operator the same way (`--shape` is ignored there): a check that
the bench runs, not a figure. `--logit-chunk-mib` sets the fp32 logits a log-prob chunk holds
(algo/grpo.py's LOGIT_CHUNK_ELEMENTS, FUSED_LOGIT_CHUNK_ELEMENTS with --compile): fewer, larger chunks
cast and accumulate the output head's weight fewer times.
Prints the split, the top kernels and, from one more step that records shapes, the top operators with
their input shapes (which tensors the kernels ran on); writes trainer_profile_<device>.json into --out (default
bench/results, or bench/results/gpu for cuda).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.model_shapes import SHAPES  # noqa: E402
from harness.result_file import write_result  # noqa: E402
from scale import PEAK_BF16_FLOPS  # noqa: E402
from trainer_memory import make_model, random_samples  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# kernel (GPU) or operator (CPU) names, by kind; the first pattern that matches a name wins
# (attention first: FlashAttention's kernels carry CUTLASS's types in their names)
KINDS = (("attention", r"flash|fmha|attention|sdpa"),
         ("matrix multiply", r"gemm|cutlass|nvjet|xmma|cublas|matmul|\baten::(mm|addmm|bmm|linear)\b"),
         ("softmax / log-probs", r"softmax|logsumexp|cross_entropy|nll_loss"),
         ("optimizer", r"adam|multi_tensor|foreach"),
         ("copy / cast", r"copy|memcpy|memset|(?<!no)cast|convert"))  # not "gpu_kernel_impl_nocast<...Mul..>"
OTHER = "elementwise / reductions"
IDLE = "GPU idle (host)"


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name, re.IGNORECASE)), OTHER)


def split(times_us: dict[str, float], wall_s: float, on_gpu: bool) -> dict[str, float]:
    """Seconds by kind of the step's kernels (or operators) `times_us` (self time by name), and on a GPU
    the rest of the wall time as idle."""
    by_kind = {kind: 0.0 for kind, _ in KINDS} | {OTHER: 0.0}
    for name, us in times_us.items():
        by_kind[kind_of(name)] += us / 1e6
    if on_gpu:
        by_kind[IDLE] = max(0.0, wall_s - sum(by_kind.values()))
    return by_kind


def profile_step(learner, samples, on_gpu: bool, record_shapes: bool = False):
    """The wall seconds of one learner step under torch.profiler, and the profile."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    with profile(activities=activities, record_shapes=record_shapes) as prof:
        sync()
        started = time.perf_counter()
        learner.step(samples)
        sync()
        wall_s = time.perf_counter() - started
    return wall_s, prof


def self_times(prof, on_gpu: bool, by_shape: bool = False) -> dict[str, float]:
    """µs by name: each kernel's own time (GPU) or operator's (CPU); with `by_shape`, each operator and
    the shapes it ran on, with the device time of the kernels it launched itself (on the CPU, its own)."""
    import torch
    times: dict[str, float] = {}
    for event in prof.key_averages(group_by_input_shape=by_shape):
        us = event.self_device_time_total if on_gpu else event.self_cpu_time_total
        kernel = event.device_type == torch.autograd.DeviceType.CUDA
        if us > 0 and (not kernel if by_shape else kernel == on_gpu):
            name = f"{event.key} {event.input_shapes}" if by_shape else event.key
            times[name] = times.get(name, 0.0) + us
    if not times:
        raise SystemExit(f"the profiler recorded no {'CUDA kernels' if on_gpu else 'operators'} in the step")
    return times


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python bench/trainer_profile.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="0.5b", help="Qwen2.5's shape (GPU only)")
    parser.add_argument("--samples", type=int, default=128, help="samples a step (the scale bench's 16 x 8)")
    parser.add_argument("--prompt", type=int, default=150, help="prompt tokens a sample")
    parser.add_argument("--response", type=int, default=512, help="response tokens a sample")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384, help="trainer.micro_batch_tokens")
    parser.add_argument("--checkpointing", action="store_true", help="trainer.gradient_checkpointing")
    parser.add_argument("--compile", action="store_true", help="trainer.compile (decoder layers and log-prob chunks, GPU only)")
    parser.add_argument("--logit-chunk-mib", type=int, default=None,
                        help="MiB of fp32 logits a log-prob chunk holds (default: 256, 1024 with --compile)")
    parser.add_argument("--top", type=int, default=15, help="how many of the longest kernels and operators to print")
    parser.add_argument("--out", type=Path, default=None, help="result directory (default bench/results[/gpu])")
    args = parser.parse_args(argv)
    if min(args.samples, args.prompt, args.response, args.micro_batch_tokens) < 1:
        parser.error("--samples, --prompt, --response and --micro-batch-tokens take positive counts")
    if args.logit_chunk_mib is not None and args.logit_chunk_mib < 1:
        parser.error("--logit-chunk-mib takes a positive count")
    import torch

    from nano_miles.algo import grpo
    if args.logit_chunk_mib is not None:
        grpo.LOGIT_CHUNK_ELEMENTS = grpo.FUSED_LOGIT_CHUNK_ELEMENTS = args.logit_chunk_mib * 2**20 // 4

    from nano_miles.run.sections import TrainerConfig
    from nano_miles.stages.trainer.learner import Learner
    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device here", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # the trainer's default trainer.num_threads
    model = make_model(args.device, SHAPES[args.shape])
    samples = random_samples(args.samples, args.prompt, args.response, model.config.vocab_size)
    cfg = TrainerConfig(lr=1e-6, micro_batch_tokens=args.micro_batch_tokens, gradient_checkpointing=args.checkpointing,
                        dtype="bfloat16" if on_gpu else "float32", compile=args.compile)
    learner = Learner(cfg, model, pad_id=0, temperature=1.0)
    for i in range(2):
        started = time.perf_counter()
        learner.step(samples)
        print(f"warm-up step {i + 1}: {time.perf_counter() - started:.2f} s", flush=True)
    wall_s, prof = profile_step(learner, samples, on_gpu)
    times = self_times(prof, on_gpu)
    # which tensors those kernels ran on: one more step, since recording shapes costs host time that the
    # timed step must not carry
    by_shape = self_times(profile_step(learner, samples, on_gpu, record_shapes=True)[1], on_gpu, by_shape=True)
    by_kind = split(times, wall_s, on_gpu)
    tokens = args.samples * (args.prompt + args.response - 1)
    num_params = sum(p.numel() for p in model.parameters())
    mfu = 6 * num_params * tokens / wall_s / PEAK_BF16_FLOPS if on_gpu else None
    top = sorted(times.items(), key=lambda kv: -kv[1])[:args.top]
    top_ops = sorted(by_shape.items(), key=lambda kv: -kv[1])[:args.top]

    where = torch.cuda.get_device_name() if on_gpu else "CPU, the small policy"
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None  # over every step above
    print(f"\none step, {where}: {args.samples} x ({args.prompt} + {args.response}) tokens, {wall_s:.3f} s, "
          f"{tokens / wall_s:,.0f} tokens/s" + (f", MFU {100 * mfu:.1f} % (6 N), peak allocated {peak_gib:.2f} GiB"
                                               if on_gpu else ""))
    print(f"{'kind':<28} {'s':>8} {'of step':>8}")
    for kind, s in by_kind.items():
        print(f"{kind:<28} {s:>8.3f} {100 * s / wall_s:>7.1f}%")
    print(f"\n{'longest ' + ('kernels' if on_gpu else 'operators'):<70} {'ms':>9}")
    for name, us in top:
        print(f"{name[:70]:<70} {us / 1e3:>9.2f}")
    print(f"\n{'longest operators, by input shapes (one more step)':<100} {'ms':>9}")
    for name, us in top_ops:
        print(f"{name[:100]:<100} {us / 1e3:>9.2f}")
    out = args.out or (RESULTS / "gpu" if on_gpu else RESULTS)
    path = out / f"trainer_profile_{args.device}.json"
    write_result(path, {"device": where, "shape": args.shape if on_gpu else "small policy",
                        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "top")},
                        "num_parameters": num_params, "step_s": wall_s, "train_tokens_per_s": tokens / wall_s,
                        "mfu": mfu, "peak_allocated_gib": peak_gib, "seconds_by_kind": by_kind,
                        "top": [{"name": name, "ms": us / 1e3, "kind": kind_of(name)} for name, us in top],
                        "top_operators": [{"name": name, "ms": us / 1e3} for name, us in top_ops]},
                 is_complete=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
