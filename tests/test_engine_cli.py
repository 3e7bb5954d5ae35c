"""The local engine's command line: a user mistake is one line on stderr and a non-zero exit, never a traceback.
Run: pytest tests/test_engine_cli.py
"""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO, free_port


def run_engine(*args: str) -> subprocess.CompletedProcess:
    # on a free port: were a mistake missed, the engine would serve until the timeout ends the test
    return subprocess.run([sys.executable, "-m", "nano_miles.local_engine", "--port", str(free_port()), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert fragment in lines[0] and "Traceback" not in lines[0]


def model_copy(policy_dir, tmp_path, edit_config=None, drop: str | None = None):
    """A copy of the small policy with its config.json rewritten by `edit_config` and the file `drop` removed."""
    model_dir = tmp_path / "model"
    shutil.copytree(policy_dir, model_dir)
    if edit_config is not None:
        config_path = model_dir / "config.json"
        config_path.write_text(edit_config(json.loads(config_path.read_text())))
    if drop is not None:
        (model_dir / drop).unlink()
    return model_dir


def test_missing_model_dir(tmp_path):
    assert_one_line_error(run_engine("--model-path", str(tmp_path / "missing")), "missing")


def test_model_dir_without_model_type(policy_dir, tmp_path):
    model_dir = model_copy(policy_dir, tmp_path, lambda c: json.dumps({k: c[k] for k in c if k != "model_type"}))
    assert_one_line_error(run_engine("--model-path", str(model_dir)), "model_type")


def test_model_dir_whose_config_is_not_json(policy_dir, tmp_path):
    model_dir = model_copy(policy_dir, tmp_path, lambda c: "{not json")
    assert_one_line_error(run_engine("--model-path", str(model_dir)), "config.json")


def test_model_dir_that_fails_to_load(policy_dir, tmp_path):
    model_dir = model_copy(policy_dir, tmp_path, drop="model.safetensors")
    assert_one_line_error(run_engine("--model-path", str(model_dir)), str(model_dir))


def test_model_dir_that_transformers_rejects(policy_dir, tmp_path):
    model_dir = model_copy(policy_dir, tmp_path, lambda c: json.dumps({**c, "model_type": "no_such_model"}))
    assert_one_line_error(run_engine("--model-path", str(model_dir)), "no_such_model")


def test_cuda_device_without_cuda(policy_dir):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    assert_one_line_error(run_engine("--model-path", str(policy_dir), "--device", "cuda"), "CUDA")


@pytest.mark.parametrize("value", ["0", "-3"])
def test_max_running_requests_below_one(policy_dir, value):
    assert_one_line_error(run_engine("--model-path", str(policy_dir), "--max-running-requests", value),
                          "--max-running-requests")


def test_help_prints_usage_and_exits():
    result = run_engine("--help")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("usage:") and "--model-path" in result.stdout


@pytest.mark.parametrize("flags, named", [(["--port", "abc"], "--port"), (["--log-level", "LOUD"], "--log-level"),
                                          (["--bogus"], "--bogus")])
def test_a_bad_flag_is_one_line_without_the_usage(policy_dir, flags, named):
    result = run_engine("--model-path", str(policy_dir), *flags)
    assert result.returncode == 2 and result.stderr.startswith("local_engine: "), result.stderr
    assert_one_line_error(result, named)
