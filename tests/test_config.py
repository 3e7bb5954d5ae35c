"""Config layering: defaults < TOML file < $NANOMILES_OVERRIDES < command line; bad keys are errors."""

import tomllib

import pytest

from nano_miles.engine.launch import engine_command
from nano_miles.run.cli import ArgumentParser
from nano_miles.run.config import ConfigError, load_config, parse_config
from nano_miles.run.run_end import decide, parse_payload


def test_layers_and_types(tmp_path, monkeypatch):
    f = tmp_path / "c.toml"
    f.write_text('[trainer]\nlr = 0.01\nnum_steps = 7\n[run]\nmode = "async"\n')
    monkeypatch.setenv("NANOMILES_OVERRIDES", "--trainer.num_steps=9 --rollout.temperature=1")
    parser = ArgumentParser()
    parser.add_argument("--out")  # an entry point's own flag, parsed beside the overrides
    cfg, args = parse_config(["--config", str(f), "--trainer.lr=2e-3", "--run.max_staleness=2", "--out=x.y"], parser)
    assert cfg.trainer.lr == 2e-3 and cfg.trainer.num_steps == 9 and cfg.run.mode == "async"
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.run.max_staleness == 2 and args.out == "x.y"


def test_dump_round_trips(tmp_path):
    cfg = load_config(overrides=["--model.path=/some dir/with \"quotes\"", "--trainer.lr=0.125"])
    f = tmp_path / "dump.toml"
    f.write_text(cfg.to_toml())
    assert tomllib.loads(f.read_text())["model"]["path"] == '/some dir/with "quotes"'
    assert load_config(f).to_dict() == cfg.to_dict()


@pytest.mark.parametrize("override, match", [
    ("--trainer.bogus=1", "unknown key.*trainer.*bogus"),
    ("--nosuch.key=1", "unknown section.*nosuch"),
    ("--trainer.lr=fast", "trainer.lr must be a number"),
    ("--trainer.num_steps=1.5", "trainer.num_steps must be an integer"),
    ("--run.mode=turbo", "run.mode"),
    ("--trainer.num_steps=0", "num_steps"),
    ("trainer-lr", "must look like --section.key=value"),
])
def test_bad_overrides_are_named(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=[override])


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(bad)


def test_engine_command_lines(tmp_path):
    local = engine_command(load_config(overrides=[f"--model.path={tmp_path}", "--engine.port=1234"]))
    assert local[1:3] == ["-m", "nano_miles.local_engine"] and local[local.index("--port") + 1] == "1234"
    sg = engine_command(load_config(overrides=[f"--model.path={tmp_path}", "--engine.kind=sglang",
                                               "--engine.dtype=bfloat16"]))
    assert sg[1:3] == ["-m", "sglang.launch_server"] and "--skip-tokenizer-init" in sg
    assert sg[sg.index("--model-path") + 1] == str(tmp_path) and sg[sg.index("--dtype") + 1] == "bfloat16"
    assert "--mem-fraction-static" in sg and sg[sg.index("--weight-version") + 1] == "0"
    assert "--disable-radix-cache" not in sg  # abort pauses empty the engine: its cache can be flushed
    in_place = engine_command(load_config(overrides=[f"--model.path={tmp_path}", "--engine.kind=sglang",
                                                     "--run.pause_mode=in_place"]))
    assert "--disable-radix-cache" in in_place


def test_run_end_listener_decisions():
    assert decide("PROCESS_STATE_EXITED", parse_payload("processname:trainer groupname:nanomiles "
                                                        "from_state:RUNNING expected:1 pid:3")) == "done"
    assert decide("PROCESS_STATE_EXITED", parse_payload("processname:trainer expected:0 pid:3")) is None
    assert decide("PROCESS_STATE_EXITED", parse_payload("processname:reward expected:1 pid:3")) is None
    assert "engine" in decide("PROCESS_STATE_FATAL", parse_payload("processname:engine from_state:BACKOFF"))


def test_entry_point_rejects_a_model_path_without_a_model(tmp_path):
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-m", "nano_miles.engine", f"--model.path={tmp_path}",
                             "--print"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "model.path" in result.stderr and "config.json" in result.stderr
    (tmp_path / "config.json").write_text("{}")
    result = subprocess.run([sys.executable, "-m", "nano_miles.engine", f"--model.path={tmp_path}",
                             "--print"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and str(tmp_path) in result.stdout
