"""Starts the configured engine in the engine slot: the local engine, or SGLang on a GPU.

Run: python -m nano_miles.engine_launch [--config FILE] [--section.key=value ...] [--print]
The process replaces itself (exec) with the engine, so supervisord's signals reach the server.
`--print` shows the command line instead of running it.
"""

from __future__ import annotations

import os
import shlex
import sys

from nano_miles.config import REPO_ROOT, Config, config_or_exit, keeps_requests

# SGLang's scheduler imports the flat-path loader by this dotted name (kept here, not imported from
# flat_sync, so that the launcher imports no torch before it execs the server)
FLAT_LOADER = "nano_miles.flat_sync.load_flat"


def engine_command(cfg: Config) -> list[str]:
    """The argv of the engine server for this config (both speak the same HTTP contract)."""
    e = cfg.engine
    common = ["--model-path", str(cfg.model_path()), "--host", e.host, "--port", str(e.port),
              "--weight-version", "0"]
    if e.kind == "local":
        return [sys.executable, str(REPO_ROOT / "procs" / "engine.py"), *common, "--device", e.device,
                "--dtype", e.dtype, "--num-threads", str(e.num_threads)]
    dtype = "bfloat16" if e.dtype == "bfloat16" else "float32"
    return [sys.executable, "-m", "sglang.launch_server", *common,
            "--skip-tokenizer-init",                      # token ids in and out, never text
            "--enable-metrics",                           # Prometheus /metrics on the same port
            "--mem-fraction-static", str(e.mem_fraction_static),  # leave GPU memory to the trainer
            "--dtype", dtype, "--random-seed", str(cfg.run.seed),
            # lets the trainer update weights through one mapped buffer (nano_miles/flat_sync.py)
            "--custom-weight-loader", FLAT_LOADER,
            # paused requests kept across an update stop SGLang flushing its prefix cache: without
            # one, no new request starts on KV of older weights
            *(["--disable-radix-cache"] if keeps_requests(cfg.run.pause_mode) else []),
            *shlex.split(e.extra_args)]


def main(argv: list[str]) -> int:
    cfg, rest = config_or_exit(argv, "engine", __doc__)
    cmd = engine_command(cfg)
    if "--print" in rest:
        print(" ".join(cmd))
        return 0
    if cfg.engine.kind == "sglang":  # SGLang's scheduler processes import the loader from the repo
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
