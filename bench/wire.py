"""Data-plane benchmark: raw-bytes vs msgpack-list encoding of a RolloutGroup, in memory and over ZeroMQ.

Run: `python bench/wire.py [--reps 5] [--seconds-per-rep 0.25]`; prints a table, writes bench/results/wire.json.

Two paths per group shape and encoding, side by side:
  codec  encode -> decode in one thread (the CPU cost of one hop, both ends on one core)
  hop    encode -> PUSH -> ipc:// -> PULL -> decode, receiver in its own process, so the two ends
         overlap as they do between two pipeline stages; timed from the first send to the
         receiver's acknowledgement of the last decoded group.
Rates are medians over repetitions of wall-clock time ("Mtok/s"). The machine is shared, so each
path also reports its CPU-bound rate ("cpu Mtok/s": tokens / CPU seconds of the busier end, zmq's
I/O thread included), which is what the hop sustains when each end has a core to itself.
Target: the bytes encoding at >= 50 M tokens/s wall-clock on every shape and path; each verdict
("met" or "missed by X Mtok/s") is printed and kept in the row.
Both encodings validate the group fully on both ends (nano_miles.wire.data checks); the list variant
differs only in how arrays travel (msgpack lists of ints / float64) and is defined here, not in the
library, because nothing but this comparison should ever use it.
The JSON is written after every measured row (`"complete": false`) and again at the end, verdicts in
(`"complete": true`), so a bench cut short keeps the rows it finished.
"""

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.result_file import write_result  # noqa: E402
from harness.verdict import Verdict, print_verdicts  # noqa: E402
from nano_miles.wire import data as wire  # noqa: E402
from nano_miles.wire.codec import make_group_id  # noqa: E402
from nano_miles.wire.data import RolloutGroup, Sample  # noqa: E402

TARGET_TOKENS_PER_S = 50e6
SHAPES = [  # (name, samples per group G, prompt tokens P, response tokens R)
    ("small G8 P32 R32", 8, 32, 32),
    ("G8 P256 R1024", 8, 256, 1024),
    ("G16 P512 R4096", 16, 512, 4096),
]
VOCAB_SIZE = 151_936
HWM_MSGS = 64  # bounds the queued bytes between the two processes, as the pipeline's sockets do


def make_group(num_samples: int, num_prompt: int, num_response: int, seed: int = 0) -> RolloutGroup:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(num_samples):
        versions = np.full(num_response, 7, dtype=np.int32)
        versions[num_response // 2:] = 8  # lived through one weight update
        samples.append(Sample(rng.integers(0, VOCAB_SIZE, num_response, dtype=np.int32),
                              -rng.exponential(1.0, num_response).astype(np.float32), versions, "length"))
    return RolloutGroup(make_group_id(0, seed), 0, rng.integers(0, VOCAB_SIZE, num_prompt, dtype=np.int32),
                        samples, {"label": "42"}, {"rollout": time.time()}, run_id="bench")


def encode_lists(g: RolloutGroup) -> bytes:
    wire.validate_rollout(g)
    return msgpack.packb({
        "v": 2, "kind": "rollout", "run_id": g.run_id, "group_id": g.group_id, "attempt": g.attempt,
        "prompt_tokens": g.prompt_tokens.tolist(),
        "samples": [{"response_tokens": s.response_tokens.tolist(), "logprobs": s.logprobs.tolist(),
                     "versions": s.versions.tolist(), "finish_reason": s.finish_reason} for s in g.samples],
        "metadata": g.metadata, "timestamps": g.timestamps})


def decode_lists(data) -> RolloutGroup:
    m = msgpack.unpackb(data)
    g = RolloutGroup(m["group_id"], m["attempt"], np.array(m["prompt_tokens"], dtype=np.int32),
                     [Sample(np.array(s["response_tokens"], dtype=np.int32), np.array(s["logprobs"], dtype=np.float32),
                             np.array(s["versions"], dtype=np.int32), s["finish_reason"]) for s in m["samples"]],
                     m["metadata"], m["timestamps"], m["run_id"])
    wire.validate_rollout(g)
    return g


CODECS = {"bytes": (wire.encode_rollout, wire.decode_rollout), "list": (encode_lists, decode_lists)}


def time_codec(group: RolloutGroup, encoding: str, num_groups: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) to encode and decode `num_groups` groups."""
    encode, decode = CODECS[encoding]
    start, start_cpu = time.perf_counter(), time.process_time()
    for _ in range(num_groups):
        decode(encode(group))
    return time.perf_counter() - start, time.process_time() - start_cpu


def receiver(address: str, ack_address: str, encoding: str, batches: list[int]) -> None:
    """Decode `n` groups per batch and acknowledge each batch (runs in its own process)."""
    decode = CODECS[encoding][1]
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, HWM_MSGS)
    pull.setsockopt(zmq.RCVTIMEO, 60_000)
    pull.bind(address)
    ack = ctx.socket(zmq.PUSH)
    ack.setsockopt(zmq.LINGER, 1000)
    ack.connect(ack_address)
    for num_groups in batches:
        start_cpu = time.process_time()
        for _ in range(num_groups):
            decode(pull.recv(copy=False).buffer)
        ack.send_json(time.process_time() - start_cpu)
    ack.close()
    pull.close(linger=0)
    ctx.term()


def time_hops(group: RolloutGroup, encoding: str, batches: list[int], workdir: str) -> list[tuple[float, float]]:
    """(wall seconds, CPU seconds of the busier end) for each batch of groups to go
    encode -> PUSH -> PULL -> decode."""
    address, ack_address = f"ipc://{workdir}/data-{encoding}", f"ipc://{workdir}/ack-{encoding}"
    ctx = zmq.Context()
    ack = ctx.socket(zmq.PULL)
    ack.setsockopt(zmq.RCVTIMEO, 120_000)
    ack.bind(ack_address)
    proc = mp.get_context("fork").Process(target=receiver, args=(address, ack_address, encoding, [1, *batches]))
    proc.start()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, HWM_MSGS)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(address)
    encode = CODECS[encoding][0]
    push.send(encode(group))
    ack.recv()  # handshake: the receiver is bound, connected and warm before the clock starts
    seconds = []
    for num_groups in batches:
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(num_groups):
            data = encode(group)
            push.send(data, copy=len(data) < 65536)  # zero-copy only pays for large frames
        receiver_cpu_s = ack.recv_json()
        sender_cpu_s = time.process_time() - start_cpu
        seconds.append((time.perf_counter() - start, max(sender_cpu_s, receiver_cpu_s)))
    proc.join(timeout=30)
    push.close()
    ack.close()
    ctx.term()
    if proc.exitcode != 0:
        raise RuntimeError(f"receiver exited with {proc.exitcode}")
    return seconds


def measure(name, num_samples, num_prompt, num_response, encoding, args, workdir) -> dict:
    group = make_group(num_samples, num_prompt, num_response)
    num_bytes = len(CODECS[encoding][0](group))
    # Size each repetition to about args.seconds_per_rep from a short calibration run.
    seconds_per_group = time_codec(group, encoding, 5)[0] / 5
    num_groups = int(min(20_000, max(5, args.seconds_per_rep / seconds_per_group)))
    codec_s = [time_codec(group, encoding, num_groups) for _ in range(args.reps)]
    hop_s = time_hops(group, encoding, [num_groups] * args.reps, workdir)
    row = {"shape": name, "num_samples": num_samples, "num_prompt_tokens": num_prompt,
           "num_response_tokens": num_response, "num_tokens_per_group": group.num_tokens,
           "encoding": encoding, "message_bytes": num_bytes, "num_groups_per_rep": num_groups, "reps": args.reps}
    for path, seconds in (("codec", codec_s), ("hop", hop_s)):
        wall_s, cpu_s = [s for s, _ in seconds], [c for _, c in seconds]
        groups_per_s = num_groups / statistics.median(wall_s)
        row[path] = {"groups_per_s": groups_per_s, "tokens_per_s": groups_per_s * group.num_tokens,
                     "mb_per_s": groups_per_s * num_bytes / 1e6,
                     "cpu_bound_tokens_per_s": num_groups * group.num_tokens / statistics.median(cpu_s),
                     "wall_s_per_rep": wall_s, "cpu_s_per_rep": cpu_s}
    return row


def meta() -> dict:
    return {"target_tokens_per_s": TARGET_TOKENS_PER_S, "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "numpy": np.__version__,
            "msgpack": ".".join(map(str, msgpack.version)), "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
            "load_average_1m_5m_15m": os.getloadavg(), "unix_time": time.time()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seconds-per-rep", type=float, default=0.25)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "wire.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="nm-wire-") as workdir:
        for shape in SHAPES:
            for encoding in CODECS:
                rows.append(measure(*shape, encoding, args, workdir))
                write_result(args.out, {"meta": meta(), "rows": rows}, is_complete=False)
    header = (f"{'shape':<18} {'path':<6} {'enc':<6} {'groups/s':>10} {'Mtok/s':>8} {'MB/s':>8} {'bytes/list':>10} "
              f"{'cpu Mtok/s':>10}")
    print(header + "\n" + "-" * len(header))
    verdicts = []
    for row in rows:
        if row["encoding"] != "bytes":
            continue
        lists = next(r for r in rows if r["shape"] == row["shape"] and r["encoding"] == "list")
        for path in ("codec", "hop"):
            row[path]["speedup_vs_list"] = row[path]["tokens_per_s"] / lists[path]["tokens_per_s"]
            verdicts.append(Verdict(f"{row['shape']} {path} (bytes, wall)", row[path]["tokens_per_s"] / 1e6, ">=",
                                    TARGET_TOKENS_PER_S / 1e6, "Mtok/s"))
            row[path]["verdict"] = verdicts[-1].to_json()
            for r in (row, lists):
                ratio = f"{row[path]['speedup_vs_list']:.1f}x" if r is row else ""
                print(f"{r['shape']:<18} {path:<6} {r['encoding']:<6} {r[path]['groups_per_s']:>10,.0f} "
                      f"{r[path]['tokens_per_s'] / 1e6:>8.1f} {r[path]['mb_per_s']:>8.0f} {ratio:>10} "
                      f"{r[path]['cpu_bound_tokens_per_s'] / 1e6:>10.1f}")
    print_verdicts(verdicts)
    write_result(args.out, {"meta": meta(), "rows": rows}, is_complete=True)
    print(f"load average (1, 5, 15 min): {os.getloadavg()} on {os.cpu_count()} CPUs; wrote {args.out}")


if __name__ == "__main__":
    main()
