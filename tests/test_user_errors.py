"""Every entry point, run as a real process: a user's mistake is one line on stderr and a non-zero exit,
never a traceback; `--help` explains and does nothing else (exit 0, no file written)."""

import os
import subprocess
import sys

import pytest

from harness.servers import REPO_ROOT, free_port, proc_command

PROCS = ("rollout", "reward", "trainer", "engine", "run_end")  # the files of procs/
# every other entry point of the project: `python -m <module>`
ENTRY_POINTS = {
    **{name: None for name in PROCS},
    "top": "nano_miles.observe.top", "status": "nano_miles.observe.status",
    "report": "nano_miles.observe.report", "config": "nano_miles.run.config", "keys": "nano_miles.run.keys",
    "policy": "nano_miles.policy", "fsdp_step": "harness.fsdp_step",
    "samples": "nano_miles.observe.samples", "export": "nano_miles.export",
    "word_problems": "nano_miles.tasks.word_problems",
}
READS_CONFIG = ("rollout", "reward", "trainer", "engine", "top", "status", "config")
WORD_PROBLEMS = REPO_ROOT / "examples" / "word_problems" / "train.jsonl"
TIMEOUT_S = 30  # each case fails before anything heavy is imported: well under a second


def run(tmp_path, name: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m <entry point> args` in an empty directory. A config reader also gets a private
    run dir, sockets and ports: were a mistake to slip through, the stage would disturb nothing."""
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    private = []
    if name in READS_CONFIG:
        private = [f"--run.dir={tmp_path / 'run'}", f"--engine.port={free_port()}",
                   f"--rollout.control_endpoint=ipc://{tmp_path}/control",
                   f"--reward.endpoint=ipc://{tmp_path}/reward", f"--trainer.endpoint=ipc://{tmp_path}/trainer",
                   "--rollout.metrics_port=0", "--reward.metrics_port=0", "--trainer.metrics_port=0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANOMILES_")}
    env["PYTHONPATH"] = str(REPO_ROOT)  # harness/ is not installed
    command = proc_command(name) if name in PROCS else [sys.executable, "-m", ENTRY_POINTS[name]]
    return subprocess.run([*command, *private, *args], cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_explains_and_does_nothing_else(tmp_path, name):
    result = run(tmp_path, name, "--help")
    assert result.returncode == 0, result.stderr
    prog = f"python procs/{name}.py" if name in PROCS else f"python -m {ENTRY_POINTS[name]}"
    assert result.stdout.startswith(f"usage: {prog} ") and result.stderr == ""
    assert not list((tmp_path / "cwd").iterdir()) and not (tmp_path / "run").exists()


# (entry point, arguments, what the one line must name)
MISTAKES = [
    *[(name, ["--bogus"], "--bogus") for name in ENTRY_POINTS
      if name not in ("policy", "keys", "fsdp_step", "export", "word_problems")],
    ("export", ["run", "out", "--bogus"], "--bogus"),
    ("export", ["nowhere", "out"], "nowhere"),
    ("export", ["."], "out"),
    ("samples", ["nowhere"], "nowhere"),
    ("word_problems", [], "--out"),
    ("word_problems", ["--out", "data", "--num-test", "99999"], "99999"),
    ("policy", ["build", "--out", "policy", "--bogus"], "--bogus"),
    ("keys", ["keys", "--bogus"], "--bogus"),
    ("fsdp_step", ["out.pt", "--bogus"], "--bogus"),
    ("policy", [], "command"),
    ("policy", ["eval", "--model", "nowhere"], "nowhere"),
    ("policy", ["build", "--out", "policy", "--device", "tpu"], "tpu"),
    ("keys", [], "dir"),
    ("fsdp_step", [], "out"),
    ("report", ["nowhere"], "nowhere"),
    ("top", ["--interval-s", "abc"], "--interval-s"),
    ("top", ["--interval-s", "-1"], "--interval-s"),
    ("top", ["--config"], "--config"),
    ("config", ["--config", "nowhere.toml"], "nowhere.toml"),
    ("trainer", ["--config", ".."], "config file .. cannot be read"),
    ("config", ["--trainer.lr", "1e-3"], "--trainer.lr"),
    ("config", ["--trainer.lr=fast"], "trainer.lr"),
    ("config", ["--trainer.bogus=1"], "bogus"),
    ("config", ['--task.system_prompt="You are'], "task.system_prompt"),
    ("engine", ["--model.path=nowhere"], "model.path"),
    # values the config took before and a stage then tripped over, far from the flag
    ("trainer", ["--trainer.lr=-1"], "trainer.lr"),
    ("rollout", ["--rollout.temperature=-3"], "rollout.temperature"),
    ("trainer", ["--trainer.device=tpu"], "trainer.device"),
    ("engine", ["--engine.dtype=fp8"], "engine.dtype"),
    ("engine", ["--engine.kind=local", "--engine.dtype=float16"], "engine.dtype"),
    # plug-ins: imported, and the task's size checked, when the stage starts
    ("reward", ["--reward.fn=nope.mod:fn"], "reward.fn"),
    ("rollout", ["--rollout.fn=nope.mod:fn"], "rollout.fn"),
    ("trainer", ["--rollout.fn=nano_miles.rollouts.tools:nope"], "rollout.fn"),
    ("trainer", ["--reward.fn=nano_miles.tasks.arithmetic:nope"], "reward.fn"),
    ("rollout", ["--task.name=nope.task"], "task.name"),
    ("trainer", ["--task.name=nope.task"], "task.name"),
    ("rollout", ["--task.num_train=999999"], "task.num_train"),
    ("trainer", ["--task.num_test=999999"], "task.num_test"),
    ("reward", ["--security.curve_dir=nowhere"], "security.curve_dir"),
    ("trainer", ["--trainer.resume_from=nowhere"], "trainer.resume_from"),
    ("reward", ["--reward.fns=[\"nope.mod:fn\"]"], "reward.fns[0]"),
    ("rollout", ["--task.name=nano_miles.tasks.files"], "task.train_file"),
    ("trainer", ["--task.name=nano_miles.tasks.files", "--task.train_file=nowhere.jsonl"], "nowhere.jsonl"),
    ("trainer", ["--task.name=nano_miles.tasks.files", f"--task.train_file={WORD_PROBLEMS}",
                 "--task.prompt_key=question", "--task.label_key=answer", "--task.num_test=0"], "task.test_file"),
]


@pytest.mark.parametrize("name, args, named", MISTAKES, ids=[f"{m[0]} {' '.join(m[1])}" for m in MISTAKES])
def test_a_mistake_is_one_line_naming_it(tmp_path, name, args, named):
    result = run(tmp_path, name, *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and named in result.stderr, result.stderr
    assert result.stderr.startswith(f"{name}: ") and result.stdout == ""
    assert not list((tmp_path / "cwd").iterdir())


def assert_one_line(result: subprocess.CompletedProcess, name: str, *named: str) -> None:
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{name}: ") and all(n in lines[0] for n in named), result.stderr


def rewrite(path, text: str) -> None:
    path.unlink()  # a link to the shipped file: the new text goes into a file of its own
    path.write_text(text)


STAGES = ("trainer", "rollout", "reward", "engine")  # every stage that loads the model directory
# a copy of the shipped policy with one part missing or wrong: (its name, what is done, what the line names)
BROKEN_MODELS = {
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "no weights there"),
    "no tokenizer": (lambda d: [(d / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")],
                     "no tokenizer there"),
    "no model_type": (lambda d: rewrite(d / "config.json", '{"architectures": ["Qwen2ForCausalLM"]}'),
                      "its config.json has no model_type"),
    "config.json not JSON": (lambda d: rewrite(d / "config.json", "{oops"), "its config.json is not readable"),
    "no config.json": (lambda d: (d / "config.json").unlink(), "no config.json there"),
}


# the engines take token ids and never read a tokenizer: a directory without one is theirs to serve
# (tests/test_engine.py serves such tiny models through procs/engine.py)
@pytest.mark.parametrize("stage, broken", [(stage, broken) for broken in BROKEN_MODELS for stage in STAGES
                                           if (stage, broken) != ("engine", "no tokenizer")])
def test_a_model_directory_missing_a_part_is_one_line_at_every_stage(tmp_path, stage, broken):
    from nano_miles.run.config import DEFAULT_POLICY_DIR
    model = tmp_path / "model"
    model.mkdir()
    for f in DEFAULT_POLICY_DIR.iterdir():  # links: the parts are read, never written
        (model / f.name).symlink_to(f)
    damage, named = BROKEN_MODELS[broken]
    damage(model)
    assert_one_line(run(tmp_path, stage, f"--model.path={model}"), stage, "model.path", str(model), named)


def a_file(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    return tmp_path / "a_file"


# every directory-valued key, given what it cannot use: (key, the path given, what the line says)
NOT_DIRECTORIES = [
    ("run.dir", a_file, "is a file, not a directory"),
    ("run.dir", lambda t: a_file(t) / "run", "cannot be made: "),
    ("model.path", a_file, "not a directory"),
    ("model.path", lambda t: t / "missing", "no such directory"),
    ("trainer.resume_from", a_file, "is not a directory"),
    ("trainer.resume_from", lambda t: t / "missing", "is not a directory"),
    ("security.curve_dir", a_file, "is not a directory"),
    ("security.curve_dir", lambda t: t / "missing", "does not exist"),
    ("security.curve_dir", lambda t: t / "cwd", "holds no readable allowed/, server.key, server.key_secret"),
]


@pytest.mark.parametrize("key, path, says", NOT_DIRECTORIES,
                         ids=[f"{row[0]}-{i}" for i, row in enumerate(NOT_DIRECTORIES)])
def test_a_directory_key_given_a_file_or_nothing_is_one_line(tmp_path, key, path, says):
    given = path(tmp_path)
    assert_one_line(run(tmp_path, "trainer", f"--{key}={given}"), "trainer", key, str(given), says)


def test_a_device_this_machine_lacks_is_one_line(tmp_path):
    import torch
    result = run(tmp_path, "trainer", f"--trainer.device=cuda:{torch.cuda.device_count()}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("trainer: trainer.device is 'cuda:") and len(result.stderr.splitlines()) == 1


def test_status_with_nothing_running_prints_only_its_table(tmp_path):
    """A stage that is down is no mistake: status says so in its table (exit 1) and logs nothing."""
    result = run(tmp_path, "status")
    assert result.returncode == 1 and result.stderr == "", result.stderr
    assert [line.split()[:2] for line in result.stdout.splitlines()] == [
        ["engine", "DOWN"], ["rollout", "DOWN"], ["reward", "DOWN"], ["trainer", "DOWN"]]
