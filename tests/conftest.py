"""Shared fixtures: the project's small policy and a real local engine process serving it."""

from pathlib import Path

import pytest

from nano_miles.local_engine.spawn import REPO_ROOT as REPO
from nano_miles.local_engine.spawn import free_port, start_local_engine, stop_process

__all__ = ["REPO", "free_port", "start_engine", "stop_process"]


@pytest.fixture(scope="session")
def policy_dir() -> Path:
    """The project's small policy (HF directory), built once and cached if missing."""
    from nano_miles.policy import ensure_policy

    return ensure_policy()


def start_engine(model_dir: Path, log_path: Path, *extra: str):
    """A local engine process on a free port: (Popen, base URL)."""
    return start_local_engine(model_dir, log_path, *extra)


@pytest.fixture(scope="module")
def engine_url(policy_dir, tmp_path_factory):
    """A real local engine process serving the small policy; stopped after the module."""
    log_path = tmp_path_factory.mktemp("engine") / "engine.log"
    proc, url = start_local_engine(policy_dir, log_path)
    yield url
    stop_process(proc)
