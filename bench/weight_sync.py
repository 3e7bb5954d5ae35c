"""Weight hot-update cost: shared-memory handles vs save_pretrained + reload from disk, side by side.

Run: python bench/weight_sync.py [--repeats 10] [--shapes policy,small,medium] [--out FILE]

For each model shape, one local engine process serves the model; the trainer-side model is pushed
through `/update_weights_from_tensor` (payload = shared-memory handles) and, alternately, written
with `save_pretrained` and loaded by the engine with `/update_weights_from_disk`. Medians of
`--repeats` rounds; the two paths alternate inside each round so machine noise hits both alike.
Target: the shared-memory transport at least 20x faster than the disk transport, for every shape; each shape's
verdict ("met" or "missed by X") is printed and kept in its row. Prints a table and writes
bench/results/weight_sync.json (or --out): `{"complete": ..., "rows": [one per shape]}`, written after every
shape (`"complete": false`) and again at the end, verdicts in, so a bench cut short keeps the shapes it finished.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.result_file import write_result  # noqa: E402
from harness.verdict import Verdict, print_verdicts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_SPEEDUP = 20.0  # shared memory vs save_pretrained + reload, per shape
# Random-init Qwen2 shapes (no download); "policy" is the project's small policy itself.
SHAPES = {
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=4096),
    "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=16384),
}


def make_model_dir(shape: str, root: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from harness.policy import ensure_policy
    if shape == "policy":
        return ensure_policy()
    import torch
    torch.manual_seed(0)
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=512, tie_word_embeddings=True,
                      eos_token_id=1, pad_token_id=0)
    out = root / shape
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out


def measure(shape: str, repeats: int, root: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from harness.servers import start_local_engine, stop_process
    from nano_miles.engine.client import EngineClient
    from nano_miles.weights.tensor_sender import push_weights

    model_dir = make_model_dir(shape, root)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    num_params = sum(p.numel() for p in model.parameters())
    proc, url = start_local_engine(model_dir, root / f"engine-{shape}.log")
    engine = EngineClient(url)
    shm_s, disk_s, splits = [], [], []
    try:
        push_weights(engine, model, 0)  # first push moves the storages into shared memory once
        for i in range(repeats):
            with torch.no_grad():  # a fresh "optimizer step" so every update carries new values
                for p in model.parameters():
                    p.add_(1e-4)
            t0 = time.perf_counter()
            split = push_weights(engine, model, 2 * i + 1)
            shm_s.append(time.perf_counter() - t0)
            splits.append(split)
            t0 = time.perf_counter()
            ckpt = root / f"ckpt-{shape}"
            model.save_pretrained(ckpt)
            engine.update_weights_from_disk(str(ckpt), weight_version=2 * i + 2)
            disk_s.append(time.perf_counter() - t0)
        # the last disk load must equal what the trainer holds
        probe = [1, 2, 3, 4]
        served = engine.score(probe[:2], probe[2:])
    finally:
        stop_process(proc)
    with torch.no_grad():
        logits = model(torch.tensor([probe])).logits.float().log_softmax(-1)
    local = [logits[0, 1, probe[2]].item(), logits[0, 2, probe[3]].item()]
    gap = max(abs(a - b) for a, b in zip(served, local))
    med_shm, med_disk = statistics.median(shm_s), statistics.median(disk_s)
    return {"shape": shape, "num_params": num_params, "mbytes": num_params * 4 / 1e6,
            "shm_ms": 1000 * med_shm, "disk_ms": 1000 * med_disk, "speedup": med_disk / med_shm,
            "serialize_ms": 1000 * statistics.median(s["serialize_s"] for s in splits),
            "apply_ms": 1000 * statistics.median(s["apply_s"] for s in splits),
            "max_abs_logprob_gap_after": gap, "repeats": repeats}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--shapes", default="policy,small,medium", help=f"comma list of policy,{','.join(SHAPES)}")
    p.add_argument("--out", type=Path, default=RESULTS / "weight_sync.json")
    args = p.parse_args(argv)
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s != "policy" and s not in SHAPES]
    if unknown or args.repeats < 1:
        p.error(f"unknown shapes {unknown}" if unknown else "--repeats must be >= 1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            print(f"measuring {shape} ...", flush=True)
            rows.append(measure(shape, args.repeats, Path(tmp)))
            write_result(args.out, {"rows": rows}, is_complete=False)
    print(f"\n{'shape':<8} {'params':>10} {'MB fp32':>8} {'shm ms':>8} {'(ser/apply)':>12} "
          f"{'disk ms':>8} {'speedup':>8}")
    for r in rows:
        print(f"{r['shape']:<8} {r['num_params']:>10,} {r['mbytes']:>8.1f} {r['shm_ms']:>8.1f} "
              f"{r['serialize_ms']:>5.1f}/{r['apply_ms']:<6.1f} {r['disk_ms']:>8.1f} {r['speedup']:>7.1f}x")
    verdicts = [Verdict(f"shm vs disk speedup, {r['shape']}", r["speedup"], ">=", TARGET_SPEEDUP, "x")
                for r in rows]
    print_verdicts(verdicts)
    for r, v in zip(rows, verdicts):
        r["verdict"] = v.to_json()
    write_result(args.out, {"rows": rows}, is_complete=True)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
