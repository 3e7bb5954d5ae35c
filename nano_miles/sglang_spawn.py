"""Start SGLang in the engine slot as a child process, through the project's own launcher (GPU tests, benches).

Library module: `proc, url = start_sglang(model_dir, log_path)`; `stop_sglang(proc)` after.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from nano_miles.local_engine.spawn import free_port, spawn_server, stop_process

# Without the FA3 kernels SGLang needs triton attention; CUDA graphs are left out because their
# capture costs start-up time and nothing measured here depends on decode speed.
DEFAULT_EXTRA_ARGS = "--attention-backend triton --disable-cuda-graph"


def start_sglang(model_dir: Path | str, log_path: Path, *, dtype: str = "bfloat16",
                 extra_args: str = DEFAULT_EXTRA_ARGS, mem_fraction_static: float = 0.3,
                 timeout_s: float = 420.0) -> tuple[subprocess.Popen, str]:
    """`python -m nano_miles.engine_launch` with engine.kind=sglang; waits for /health."""
    port = free_port()
    cmd = [sys.executable, "-m", "nano_miles.engine_launch", f"--model.path={model_dir}",
           "--engine.kind=sglang", f"--engine.dtype={dtype}", f"--engine.port={port}",
           f"--engine.mem_fraction_static={mem_fraction_static}", f"--engine.extra_args={extra_args}"]
    # own process group (new session): SGLang's scheduler and detokenizer children go down with it
    return spawn_server(cmd, log_path, f"http://127.0.0.1:{port}", timeout_s, stop_sglang,
                        is_new_session=True)


def stop_sglang(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    stop_process(proc, timeout_s, is_group=True)
