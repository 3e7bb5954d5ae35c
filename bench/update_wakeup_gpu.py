"""Why a flat weight update costs more inside the pipeline than back to back: what came before it.

Run on a GPU host with sglang: python bench/update_wakeup_gpu.py [--rounds 8] [--out bench/results/gpu]

`bench/weight_sync_gpu.py` pushes its updates back to back and times the flat transport's apply at about
4.5 ms at the Qwen2.5-0.5B shape; in a pipeline run the same apply takes about 5.5 ms. An update in a
run follows a second of generating (sync) or of the engine waiting (the trainer's step), never another
update. This bench serves the same random-init model from one SGLang server per pause mode (in_place:
started without a radix cache, as the GPU configs run it; abort: with one) and, per round, pushes the
flat buffer once under each condition, interleaved so that machine noise hits all alike:

* idle: right after the previous update (what the standalone bench measures)
* after_gen: right after a generate batch of 64 prompts x 16 new tokens (a sync step's order)
* after_gen_noflush: the same, with `flush_cache` false
* after_sleep1: after one second with nothing to do (the engine's side of a training step)
* idle_noflush: back to back, `flush_cache` false

Prints the median gather / serialize / apply per condition (ms) and writes update_wakeup.json, after
every pause mode's server (`"complete": false`, the modes so far) and again at the end, so a bench cut
short keeps the modes it finished.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.result_file import write_result  # noqa: E402

PARTS = ("gather", "serialize", "apply")
PAUSE_MODES = ("in_place", "abort")


def measure(model, model_dir: Path, pause_mode: str, rounds: int, log_dir: Path) -> dict:
    import torch

    from harness.servers import SGLANG_EXTRA_ARGS, launch, stop_sglang
    from nano_miles.engine.client import EngineClient
    from nano_miles.weights.flat_sender import FlatSender

    params = list(model.parameters())
    proc, url = launch(model_dir, log_dir / f"sglang_{pause_mode}.log", [
        "--engine.kind=sglang", "--engine.dtype=bfloat16", "--engine.mem_fraction_static=0.3",
        f"--engine.extra_args={SGLANG_EXTRA_ARGS}", f"--run.pause_mode={pause_mode}"],
        420, stop_sglang, is_new_session=True)
    version = 0
    try:
        client, generator = EngineClient(url), EngineClient(url)  # the producer has its own connection
        sender = FlatSender(client)

        def push(flush: bool = True) -> dict:
            nonlocal version
            version += 1
            with torch.no_grad():  # new values every time, as after an optimizer step
                torch._foreach_add_(params, 1e-4)
            return sender.push(model, version, flush_cache=flush)

        def generate() -> None:
            generator.generate([[5, 6, 7, 8, 9, 10 + i] for i in range(64)],
                               {"max_new_tokens": 16, "temperature": 1.0})

        conditions = {"idle": push,
                      "after_gen": lambda: (generate(), push())[1],
                      "after_gen_noflush": lambda: (generate(), push(False))[1],
                      "after_sleep1": lambda: (time.sleep(1.0), push())[1],
                      "idle_noflush": lambda: push(False)}
        for _ in range(3):  # the first updates map the buffer and build the engine's copy plan
            push()
        times = {name: [] for name in conditions}
        for _ in range(rounds):
            for name, run in conditions.items():
                times[name].append(run())
    finally:
        stop_sglang(proc)
    return {name: {f"{p}_ms": 1000 * statistics.median(t[f"{p}_s"] for t in ts) for p in PARTS}
            for name, ts in times.items()}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gpu"))
    args = p.parse_args(argv)
    if args.rounds < 5:
        p.error("--rounds must be >= 5 (medians of fewer say little)")
    import torch

    from weight_sync_gpu import make_model
    path = Path(args.out) / "update_wakeup.json"
    result = {"gpu": torch.cuda.get_device_name(), "rounds": args.rounds, "pause_modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model, model_dir = make_model(Path(tmp))
        for mode in PAUSE_MODES:
            result["pause_modes"][mode] = measure(model, model_dir, mode, args.rounds, Path(tmp))
            write_result(path, result, is_complete=False)
    print(f"\n{'pause mode':<10} {'condition':<18} " + " ".join(f"{p:>9}" for p in PARTS))
    for mode, rows in result["pause_modes"].items():
        for name, row in rows.items():
            print(f"{mode:<10} {name:<18} " + " ".join(f"{row[p + '_ms']:>9.2f}" for p in PARTS))
    write_result(path, result, is_complete=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
