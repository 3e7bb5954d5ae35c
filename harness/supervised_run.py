"""Runs the repo's real supervisord.conf in a private run directory, on private endpoints.

Used by the pipeline tests and the bench scripts: `SupervisedRun(run_dir, overrides).start().wait(t)`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness.servers import REPO_ROOT as REPO
from harness.servers import free_port, free_ports_in_a_row, unwind_on_sigterm
from nano_miles.run.sections import MAX_REPLICAS
from nano_miles.run.process import processes_of_run
from nano_miles.observe.run_record import read_jsonl


class SupervisedRun:
    """The repo's supervisord.conf with its run directory moved to `run_dir`, on private endpoints."""

    def __init__(self, run_dir: Path, overrides: list[str], *, is_autostart: bool = True, config: str | None = None):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        text = (REPO / "supervisord.conf").read_text()
        text = text.replace("%(here)s/runs/current", str(run_dir)).replace("%(here)s", str(REPO))
        if not is_autostart:  # the test starts each stage itself, in an order of its choosing
            text = re.sub(r"^(\[program:\w+\])$", r"\1\nautostart=false", text, flags=re.M)
        self.conf = run_dir / "supervisord.conf"
        self.conf.write_text(text)
        endpoints = [f"--engine.port={free_ports_in_a_row(MAX_REPLICAS)}",
                     f"--engine.router_port={free_ports_in_a_row(2)}",  # and its Prometheus port
                     f"--rollout.control_endpoint=ipc://{run_dir}/control.sock",
                     f"--reward.endpoint=ipc://{run_dir}/reward.sock",
                     f"--trainer.endpoint=ipc://{run_dir}/trainer.sock",
                     f"--rollout.metrics_port={free_port()}", f"--reward.metrics_port={free_port()}",
                     f"--trainer.metrics_port={free_port()}"]
        self.overrides = endpoints + overrides  # what every stage of this run reads
        self.env = {**os.environ,
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                    "NANOMILES_OVERRIDES": " ".join(shlex.quote(o) for o in self.overrides)}
        if config is not None:  # a config file of the repo's, e.g. "configs/tools.toml"
            self.env["NANOMILES_CONFIG"] = str(REPO / config)
        self.proc: subprocess.Popen | None = None
        self.output = run_dir / "supervisord.out"

    def start(self) -> "SupervisedRun":
        # as a module of this interpreter: offline bundles carry the package without its console scripts
        # appended to, not written at an offset: the trainer's log reaches the same file through a
        # second open of /dev/stdout (supervisord.conf), and the two would overwrite each other
        self.output.write_bytes(b"")
        unwind_on_sigterm()  # supervisord runs in a session of its own: a killed caller must stop it
        self.proc = subprocess.Popen([sys.executable, "-m", "supervisor.supervisord", "-c", str(self.conf)],
                                     cwd=REPO, env=self.env, stdout=self.output.open("ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"run did not finish in {timeout_s}s; last output:\n{self.tail()}")

    def wait_for_socket(self, timeout_s: float = 30) -> None:
        """supervisord is up once its control socket exists (then supervisorctl works)."""
        deadline = time.monotonic() + timeout_s
        while not (self.run_dir / "supervisor.sock").exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"supervisord did not come up:\n{self.tail()}")
            time.sleep(0.1)

    def ctl(self, *args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-c", str(self.conf), *args],
                             env=self.env, capture_output=True, text=True, timeout=60)
        return out.stdout + out.stderr

    def tail(self, num_chars: int = 4000) -> str:
        parts = []
        for name in ("supervisord.out", "trainer.log", "rollout.log", "reward.log", "engine.log", "engine_1.log",
                     "router.log"):
            p = self.run_dir / name
            if p.exists():
                parts.append(f"--- {name}\n{p.read_text()[-num_chars:]}")
        return "\n".join(parts)

    def metrics(self) -> list[dict]:
        return read_jsonl(self.run_dir / "metrics.jsonl")

    def steps(self) -> dict[int, dict]:
        """The last record of each step: steps re-done after a trainer restart replace the lost ones."""
        return {r["step"]: r for r in self.metrics()}

    def wait_for_step(self, step: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while max(self.steps(), default=0) < step:
            assert time.monotonic() < deadline and self.proc.poll() is None, self.tail()
            time.sleep(0.1)

    def stage_pid(self, stage: str, timeout_s: float = 60) -> int:
        """The pid of a RUNNING stage (waits while supervisord restarts it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the run ended while waiting for {stage}"
            if "RUNNING" in self.ctl("status", f"nanomiles:{stage}"):
                pid = self.ctl("pid", f"nanomiles:{stage}").strip()
                if pid.isdigit() and int(pid) > 0:
                    return int(pid)
            time.sleep(0.2)
        raise AssertionError(f"{stage} did not come back:\n{self.tail()}")

    def kill(self, stage: str, timeout_s: float = 300) -> dict:
        """SIGKILL a stage; return how long until it ran again (`restarted_s`), until a step newer than
        the last one before the kill was done (`next_step_s`), and that step's record."""
        pid = self.stage_pid(stage)
        last_step = max(self.steps(), default=0)
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        while self.stage_pid(stage) == pid:
            time.sleep(0.1)
        back_s = time.monotonic() - started
        while max(self.steps(), default=0) <= last_step and self.proc.poll() is None:
            assert time.monotonic() - started < timeout_s, f"no progress after killing {stage}:\n{self.tail()}"
            time.sleep(0.1)
        return {"stage": stage, "restarted_s": back_s, "next_step_s": time.monotonic() - started,
                "next_step": self.steps().get(last_step + 1)}

    def summary(self) -> dict:
        """The run's summary.json; a run that ended without one failed (supervisord itself exits 0 after
        run_end shuts it down), so say why rather than FileNotFoundError."""
        path = self.run_dir / "summary.json"
        assert path.exists(), f"the run wrote no summary.json:\n{self.tail()}"
        return json.loads(path.read_text())

    def stop(self) -> None:
        """Tear down supervisord and every stage it started, whatever state they are in (also a stage
        that outlived a supervisord killed by the test)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid in processes_of_run(self.run_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
