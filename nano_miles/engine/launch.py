"""The engine slots' command lines: the local engine or SGLang (both serve one HTTP contract), and the
router in front of several of them.

Library module of `procs/engine.py`, which execs one of these in each slot of supervisord.conf.
"""

from __future__ import annotations

import errno
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from nano_miles.engine.client import keeps_requests
from nano_miles.run.cli import UserError
from nano_miles.run.config import Config
from nano_miles.run.process import processes_of_run

# SGLang's scheduler imports the flat-path loader by this dotted name (a string here, so that the
# launcher imports no torch before it execs the server)
FLAT_LOADER = "nano_miles.weights.flat_receiver.load_flat"

GIB = 2**30
# Beyond its static share SGLang allocates its CUDA graphs and prefill activations (the trainer's memory
# plan leaves it 8 GiB for them); an engine with less than this free beside its share is refused at
# once rather than left to fail after loading its model.
ENGINE_MIN_HEADROOM_GIB = 2.0


def is_truncated(cfg: Config) -> bool:
    """Does rollout sampling cut the distribution (top-p or top-k)?"""
    return cfg.rollout.top_p < 1.0 or cfg.rollout.top_k > 0


def engine_command(cfg: Config, replica: int = 0, gpu_memory: tuple[int, int] | None = None) -> list[str]:
    """The argv of engine `replica` (0 .. engine.replicas - 1) for this config; it serves on port + replica.
    `gpu_memory`: SGLang's GPU's (free, total) bytes as it starts (`sglang_fraction`); without it the
    config's engine.mem_fraction_static is passed as it is."""
    e = cfg.engine
    common = ["--model-path", str(cfg.model_dir), "--host", e.host, "--port", str(e.port + replica),
              "--weight-version", "0", "--random-seed", str(cfg.run.seed)]
    if e.kind == "local":
        device = f"cuda:{cfg.engine_gpu(replica)}" if e.device == "cuda" else e.device
        return [sys.executable, "-m", "nano_miles.local_engine", *common, "--device", device,
                "--dtype", e.dtype, "--num-threads", str(e.num_threads)]
    return [sys.executable, "-m", "sglang.launch_server", *common,
            *(["--base-gpu-id", str(cfg.engine_gpu(replica))] if "--base-gpu-id" not in e.extra_args else []),
            "--skip-tokenizer-init",                      # token ids in and out, never text
            "--enable-metrics",                           # Prometheus /metrics on the same port
            "--mem-fraction-static",  # leave GPU memory to the trainer
            str(sglang_fraction(cfg, replica, *gpu_memory) if gpu_memory else e.mem_fraction_static),
            "--dtype", e.dtype,                           # the config's names are SGLang's too
            # every rollout request carries a sampling_seed, which SGLang's flashinfer sampler refuses
            # once top-p or top-k truncates (docs/sglang-contract.md §2.1); its torch sampler takes it
            *(["--sampling-backend", "pytorch"] if is_truncated(cfg) and "--sampling-backend" not in e.extra_args
              else []),
            # lets the trainer update weights through one mapped buffer (nano_miles/weights/flat_receiver.py)
            "--custom-weight-loader", FLAT_LOADER,
            # paused requests kept across an update stop SGLang flushing its prefix cache: without
            # one, no new request starts on KV of older weights
            *(["--disable-radix-cache"] if keeps_requests(cfg.run.pause_mode) else []),
            *(["--cuda-graph-max-bs", str(graph_batch_size(cfg))] if "--cuda-graph-max-bs" not in e.extra_args
              else []),
            *shlex.split(e.extra_args)]


def sglang_fraction(cfg: Config, replica: int, free_bytes: int, total_bytes: int) -> float:
    """SGLang's --mem-fraction-static that gives it the config's engine.mem_fraction_static of its whole GPU.

    SGLang 0.5.16 sizes its static share (weights and KV cache) as the flag times the GPU memory free when
    its model loads, not times the whole GPU (`kv_cache_configurator._profile_available_bytes`). The config's
    value is a share of the whole GPU, as the trainer's memory plan counts it. An engine started beside a
    trainer that holds memory already (a restarted engine) would otherwise get that share of what is left:
    on an 80 GB card, SGLang at 0.1 starting while other processes held 26 GB (a 3B trainer loading its
    policy among them) got too little for its own weights and failed, start after start.
    A UserError (one line) if the GPU has not that much free now."""
    want = cfg.engine.mem_fraction_static * total_bytes
    if want > free_bytes - ENGINE_MIN_HEADROOM_GIB * GIB:
        raise UserError(f"engine.mem_fraction_static = {cfg.engine.mem_fraction_static} asks {want / GIB:.1f} GiB "
                        f"of GPU {cfg.engine_gpu(replica)} ({total_bytes / GIB:.1f} GiB), and {free_bytes / GIB:.1f} "
                        f"GiB is free ({ENGINE_MIN_HEADROOM_GIB:.0f} GiB more is needed beside it): free the GPU or "
                        "lower engine.mem_fraction_static")
    return round(want / free_bytes, 4)


def gpu_memory(gpu: int) -> tuple[int, int]:
    """(free, total) bytes of visible CUDA device `gpu`, read in a child process, so that this process,
    which becomes the server, holds no CUDA context of its own."""
    probe = f"import torch; print(*torch.cuda.mem_get_info({gpu}))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    if done.returncode:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise UserError(f"cannot read the memory of GPU {gpu}: {why}")
    free, total = map(int, done.stdout.split())
    return free, total


# SGLang decodes a batch of at most --cuda-graph-max-bs requests in a captured CUDA graph, a larger one
# eagerly, step by step (its default: 256 on an H100/H200). A bigger cap costs capture time at start
# and graph memory, so it stops here.
MAX_GRAPH_BATCH = 1024


def graph_batch_size(cfg: Config) -> int:
    """The largest decode batch an engine captures: every sample the producer can have in flight
    (max_inflight_groups x group_size, shared between the replicas), up to MAX_GRAPH_BATCH."""
    in_flight = cfg.rollout.max_inflight_groups * cfg.rollout.group_size
    return max(1, min(MAX_GRAPH_BATCH, -(-in_flight // cfg.engine.replicas)))


def engine_env(cfg: Config) -> dict[str, str]:
    """Environment an engine is started with (a variable already set wins).

    SGLang 0.5.16's /health runs a one-token generation under the lock that weight updates take
    exclusively, and its scheduler leaves that generation unanswered while it is busy, so one check
    can hold the lock for a second (SGLang's `http_server.health_generate` and
    `scheduler.Scheduler.process_input_requests`). Behind the router, which checks every engine once a second, updates
    of idle engines took 357 ms p50 on an H200 against 5 ms for one engine; this lock is the cause
    the source points to. Without the generation /health still answers 503 while the server starts,
    and a dead scheduler takes the whole server down with it."""
    if cfg.engine.kind != "sglang":
        return {}
    return {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}


def router_command(cfg: Config) -> list[str]:
    """The argv of sglang-router in front of the replicas: generation is spread round robin; control
    calls and weight updates bypass it (nano_miles/engine/group.py)."""
    e = cfg.engine
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", e.host, "--port", str(e.router_port),
            "--policy", "round_robin", "--worker-urls", *e.engine_urls,
            "--prometheus-port", str(e.router_port + 1),  # its default port would clash between runs
            # A replica killed mid-run opens its circuit: the router retries its requests on another
            # one and, after this long, tries the restarted replica again (default: a minute).
            "--cb-timeout-duration-secs", "3", "--health-check-interval-secs", "1",
            "--log-level", "warn"]  # info logs two lines per request


def refuse_a_missing_gpu(cfg: Config, replica: int) -> None:
    """A UserError (one line) if engine `replica` is laid out on a GPU this host does not show (the
    server itself would fail deep in its start with a CUDA error)."""
    if not cfg.engine_gpus_here:
        return
    import torch  # here only: the CPU engines' launcher needs none
    gpu, visible = cfg.engine_gpu(replica), torch.cuda.device_count()
    if gpu >= visible:
        layout = ("engine.colocate = false puts the engines on GPUs after the trainer's" if not cfg.engine.colocate
                  else "engine.colocate = true puts the engines on the trainer's GPUs")
        raise UserError(f"engine {replica} needs GPU {gpu}, but {visible or 'no'} GPU{'' if visible == 1 else 's'} "
                        f"{'is' if visible == 1 else 'are'} visible ({layout})")


def refuse_a_held_port(host: str, port: int, run_dir: Path) -> None:
    """A UserError (one line) if `port` on `host` cannot be listened on, naming the process that
    holds it when that is one started for this run directory: an engine left running by an earlier
    supervisord of this run that was itself killed. Without the check the new engine would crash
    in a loop on "Address already in use" while the stages talk to the old one."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is fine
        try:
            probe.bind((host, port))
            return
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    pid = next((pid for pid, argv in processes_of_run(run_dir).items() if str(port) in argv), None)
    if pid is not None:
        raise UserError(f"port {port} is held by pid {pid}, an engine an earlier start of {run_dir} left "
                        f"running (was its supervisord killed?): stop it (kill {pid}) and start again")
    raise UserError(f"port {port} on {host} is in use by another program: stop it or choose another "
                    "engine.port (engine.router_port for the router)")
