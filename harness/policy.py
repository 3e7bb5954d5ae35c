"""The policy tests and benches run on: the small one shipped in the package, or one built once into a
cache directory where a checkout lacks it (`NANO_MILES_CACHE`, default ~/.cache/nano-miles)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from nano_miles.policy.build import build_policy
from nano_miles.run.config import DEFAULT_POLICY_DIR

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def ensure_policy() -> Path:
    """The committed policy if present, else one built once into the cache directory."""
    if is_complete(DEFAULT_POLICY_DIR):
        return DEFAULT_POLICY_DIR
    cache_dir = Path(os.environ.get("NANO_MILES_CACHE", Path.home() / ".cache" / "nano-miles")) / "policy"
    if not is_complete(cache_dir):
        # Build next to the target and rename, so an interrupted build never looks complete.
        tmp_dir = cache_dir.with_name(f"policy.tmp{os.getpid()}")
        build_policy(tmp_dir)
        if is_complete(cache_dir):  # a concurrent build finished first; keep its copy
            shutil.rmtree(tmp_dir)
        else:
            tmp_dir.replace(cache_dir)
    return cache_dir
