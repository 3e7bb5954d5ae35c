"""Config layering: defaults < TOML file < $NANOMILES_OVERRIDES < command line; bad keys are errors."""

import dataclasses
import tomllib
from pathlib import Path

import pytest

from harness.servers import REPO_ROOT, proc_command
from nano_miles.engine.launch import engine_command
from nano_miles.run.cli import ArgumentParser
from nano_miles.run.config import DEFAULT_POLICY_DIR, Config, ConfigError, load_config, parse_config
from nano_miles.run.sections import RunConfig


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


def test_a_key_counts_as_set_only_where_the_user_chose_it(tmp_path, monkeypatch):
    """configs/default.toml spells out the defaults: its keys are not the user's choice; any other
    config file's keys and every override are."""
    assert load_config().set_keys == frozenset() and load_config("configs/default.toml").set_keys == frozenset()
    f = tmp_path / "c.toml"
    f.write_text("[task]\nnum_test = 200\n")
    monkeypatch.setenv("NANOMILES_OVERRIDES", "--trainer.lr=1e-3")
    cfg = load_config(f, ["--run.seed=1"])
    assert cfg.set_keys == {"task.num_test", "trainer.lr", "run.seed"}
    assert cfg.is_set("task.num_test") and not cfg.is_set("task.num_train") and not Config().is_set("run.seed")
    assert Config(run=RunConfig(seed=3)).is_set("run.seed")  # a value other than the default is always a choice


@pytest.mark.parametrize("override, key, value", [
    ("--run.dir=1e3", "run.dir", "1e3"),               # a string field takes the text as typed
    ("--run.dir=true", "run.dir", "true"),
    ("--run.dir=[INST]", "run.dir", "[INST]"),
    ("--task.prompt_key={a=1}", "task.prompt_key", "{a=1}"),
    ("--run.dir='\"my run\"'", "run.dir", '"my run"'),  # TOML quotes come off
    ('--run.dir="my run"', "run.dir", "my run"),
    ("--trainer.lr=1e-3", "trainer.lr", 1e-3),         # any other field reads one TOML value
    ("--reward.weights=[1, 0.5]", "reward.weights", [1, 0.5]),
])
def test_an_override_is_read_as_its_fields_type(override, key, value):
    section, name = key.split(".")
    fns = ['--reward.fns=["a:b", "c:d"]'] if section == "reward" else []
    assert getattr(getattr(load_config(overrides=[override, *fns]), section), name) == value


@pytest.mark.parametrize("override, match", [
    ('--task.system_prompt="You are', r'^task.system_prompt: "You are opens a TOML string that does not parse'),
    ("--trainer.lr=1\nx = 2", r"^trainer.lr must be a number, not '1\\nx = 2'$"),  # not one value
    ("--reward.weights=[1, 2", r"^reward.weights must be a list of finite numbers, not '\[1, 2'$"),
])
def test_an_override_that_does_not_parse_is_named(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=[override])


def test_a_config_file_or_overrides_that_cannot_be_read_are_named(tmp_path, monkeypatch):
    not_utf8 = tmp_path / "latin1.toml"
    not_utf8.write_bytes(b'[task]\nsystem_prompt = "caf\xe9"\n')
    for path, says in ((tmp_path, "Is a directory"), (not_utf8, "can't decode byte 0xe9")):
        with pytest.raises(ConfigError, match=rf"^config file {path} cannot be read as text \(.*{says}"):
            load_config(path)
    monkeypatch.setenv("NANOMILES_OVERRIDES", '--task.system_prompt="Be brief.')
    with pytest.raises(ConfigError, match=r"^\$NANOMILES_OVERRIDES does not split into words \(No closing quotation"):
        load_config()


def test_a_file_value_of_the_wrong_type_is_named(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[run]\ndir = 1e3\n")
    with pytest.raises(ConfigError, match=r"^run.dir must be a string, not 1000.0 \(a TOML string is in quotes\)$"):
        load_config(f)


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


@pytest.mark.parametrize("override, match", [
    ("--trainer.lr=-1", r"trainer.lr must be >= 0, not -1.0"),
    ("--trainer.lr=nan", r"trainer.lr must be >= 0, not nan"),
    ("--rollout.temperature=-3", r"rollout.temperature must be >= 0"),
    ("--rollout.top_p=0", r"rollout.top_p must be in \(0, 1\]"),
    ("--rollout.top_k=0", r"rollout.top_k must be -1 \(off\) or >= 1"),
    ("--trainer.device=tpu", r"trainer.device must be cpu, cuda or cuda:N, not 'tpu'"),
    ("--engine.dtype=fp8", r"engine.dtype must be one of float32, bfloat16, float16, not 'fp8'"),
    ("--engine.dtype=float16", r"engine.dtype must be float32 or bfloat16 with engine.kind=local"),
    ("--engine.device=cuda:1", r"engine.device must be cpu or cuda with engine.kind=local"),
    ("--engine.port=0", r"engine.port must be a TCP port in \[1, 65535\]"),
    ("--engine.mem_fraction_static=1.5", r"engine.mem_fraction_static must be in \(0, 1\]"),
    ("--engine.extra_args='--x \"y'", r"engine.extra_args must be shell words"),
    ("--engine.router_url=localhost:1", r"engine.router_url"),
    ("--engine.replicas=5", r"engine.replicas must be in \[1, 4\] \(the engine slots of supervisord.conf\)"),
    ("--trainer.eps_clip=1", r"trainer.eps_clip must be in \(0, 1\)"),
    ("--trainer.dual_clip_c=1", r"trainer.dual_clip_c must be > 1"),
    ("--trainer.endpoint=localhost:5703", r"trainer.endpoint must be a ZeroMQ endpoint"),
    ("--trainer.control_retries=0", r"trainer.control_retries must be >= 1"),
    ("--reward.fn=reward", r"reward.fn must be package.module:function"),
    ("--task.name=nope-task", r"task.name must be a dotted module name"),
    ("--task.num_test=-1", r"task.num_test must be >= 0"),
    ("--metrics.queue_sample_s=-1", r"metrics.queue_sample_s must be >= 0"),
    ("--reward.fns=[\"a:b\", 3]", r"reward.fns must be a list of \"package.module:function\" strings"),
    ("--reward.weights=[1, true]", r"reward.weights must be a list of finite numbers"),
    ("--trainer.eval_samples=0", r"trainer.eval_samples must be >= 1"),
    ("--reward.max_failure_fraction=1.5", r"reward.max_failure_fraction must be in \[0, 1\]"),
    ("--run.dir=", r"run.dir must be a non-empty string"),
    ("--run.max_staleness=2", r"^run.max_staleness = 2 bounds the staleness of run.mode=async; sync is on-policy"),
    ("--task.system_prompt=Be brief.", r"^task.system_prompt is a turn of the chat template: set task.chat_template"),
    ("--task.train_file=data.jsonl", r"^task.train_file is data for task.name=nano_miles.tasks.files; the arithmetic"),
    ("--trainer.lr_min=1e-5", r"^trainer.lr_min is where trainer.lr_schedule=cosine ends; the constant schedule"),
    ("--trainer.loss=ppo", r"trainer.loss must be one of dapo, grpo, dr_grpo, gspo, gspo_token, cispo, not 'ppo'"),
    ("--trainer.advantage=gae", r"trainer.advantage must be one of grpo, rloo, reinforce_pp, not 'gae'"),
    ("--trainer.num_iterations=0", r"trainer.num_iterations must be >= 1"),
])
def test_values_out_of_range_name_the_key_and_what_is_allowed(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=[override])


@pytest.mark.parametrize("overrides, match", [
    (["--trainer.advantage=rloo", "--trainer.scale_rewards=none"],
     r"^trainer.scale_rewards=none is the grpo estimator's option; trainer.advantage=rloo scales its own way"),
    (['--reward.fns=["nano_miles.tasks.arithmetic:reward", "nano_miles.rewards.overlong:reward"]',
      "--reward.overlong_buffer=64"], r"^reward.overlong_buffer \(64\) is longer than rollout.max_new_tokens \(48\)"),
    (["--trainer.kl_in=reward"], r"^trainer.kl_in and trainer.kl_estimator shape the KL penalty, which is off"),
    (["--trainer.kl_estimator=k1"], r"^trainer.kl_in and trainer.kl_estimator shape the KL penalty, which is off"),
    (["--trainer.mini_batches=200", "--trainer.batch_groups=4"],
     r"^trainer.mini_batches \(200\) is more than a step's 32 samples \(trainer.batch_groups x rollout.group_size\)"),
])
def test_algorithm_settings_that_do_not_go_together_are_refused(overrides, match):
    """(also the overlong penalty's ramp, which must fit in the budget when the function is used)"""
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=overrides)
    load_config(overrides=["--trainer.kl_coef=0.01", "--trainer.kl_in=reward", "--trainer.kl_estimator=k1",
                           "--trainer.scale_rewards=none", "--trainer.mini_batches=128"])


def test_the_algorithm_names_are_the_ones_algo_picks_its_functions_by():
    from nano_miles.algo import advantages, loss
    from nano_miles.run import sections
    assert sections.ADVANTAGES == tuple(advantages.ESTIMATORS) and sections.REWARD_SCALES == advantages.SCALES
    assert sections.LOSSES == loss.LOSSES and sections.KL_ESTIMATORS == loss.KL_ESTIMATORS


def test_replicas_are_engines_started_here_and_get_a_router():
    with pytest.raises(ConfigError, match=r"engine.replicas starts engines here, engine.urls names engines"):
        load_config(overrides=["--engine.replicas=2", '--engine.urls=["http://h:1", "http://h:2"]',
                               "--engine.router_url=http://h:3"])
    e = load_config(overrides=["--engine.replicas=3", "--engine.port=4000", "--engine.router_port=4100"]).engine
    assert e.engine_urls == ["http://127.0.0.1:4000", "http://127.0.0.1:4001", "http://127.0.0.1:4002"]
    assert e.generation_url == "http://127.0.0.1:4100"
    assert load_config().engine.generation_url == ""  # one engine: generation goes to it directly


def test_supervisord_conf_has_a_slot_for_every_replica_a_config_may_ask_for():
    import configparser

    from nano_miles.run.sections import MAX_REPLICAS
    conf = configparser.RawConfigParser()
    conf.read(REPO_ROOT / "supervisord.conf")
    assert 1 + int(conf["program:replica"]["numprocs"]) == MAX_REPLICAS  # engine, then replicas 1..N-1
    assert int(conf["program:replica"]["numprocs_start"]) == 1
    assert {"engine", "replica", "router"} <= set(conf["group:nanomiles"]["programs"].split(","))


def test_one_weight_per_reward_function():
    with pytest.raises(ConfigError, match=r"reward.weights has 2 numbers for 1 reward.fns"):
        load_config(overrides=['--reward.fns=["a:b"]', "--reward.weights=[1, 2]"])
    assert load_config(overrides=['--reward.fns=["a:b", "c.d"]', "--reward.weights=[1, 0.5]"]).reward.weights == [1, 0.5]


@pytest.mark.parametrize("overrides", [
    ["--trainer.device=cuda:1", "--engine.kind=sglang", "--engine.device=cuda:1", "--engine.dtype=float16"],
    ["--engine.device=cuda", "--engine.dtype=bfloat16", "--rollout.temperature=0", "--rollout.top_k=5"],
    ["--rollout.control_endpoint=ipc:///tmp/x/control", "--engine.urls=[\"http://h:1\", \"http://h:2\"]",
     "--engine.router_url=http://h:3", "--engine.weight_group_port=0", "--reward.fn=a.b.c"],
])
def test_values_in_range_are_kept(overrides):
    load_config(overrides=overrides)


@pytest.mark.parametrize("path", sorted((Path(__file__).parent.parent / "configs").glob("*.toml")), ids=str)
def test_shipped_configs_pass_their_checks(path):
    cfg = load_config(path)
    # SGLang decodes in CUDA graphs unless told not to; without them generation of the Qwen2.5-0.5B
    # shape was 5.7x slower on an H200 (bench/results/gpu/README.md), so no shipped config turns them off
    assert "--disable-cuda-graph" not in engine_command(cfg)


def test_sglang_captures_graphs_for_every_sample_in_flight():
    def graph_cap(*overrides):
        argv = engine_command(load_config(overrides=["--engine.kind=sglang", *overrides]))
        return int(argv[argv.index("--cuda-graph-max-bs") + 1])
    assert graph_cap("--rollout.max_inflight_groups=32", "--rollout.group_size=8") == 256
    assert graph_cap("--rollout.max_inflight_groups=3", "--rollout.group_size=5") == 15
    assert graph_cap("--rollout.max_inflight_groups=128", "--rollout.group_size=16") == 1024  # capture stops there
    assert graph_cap("--rollout.max_inflight_groups=10", "--rollout.group_size=8", "--engine.replicas=3") == 27
    argv = engine_command(load_config(overrides=["--engine.kind=sglang", "--engine.extra_args=--cuda-graph-max-bs 8"]))
    assert argv.count("--cuda-graph-max-bs") == 1 and argv[-1] == "8"  # the user's own wins


def test_the_tests_start_sglang_with_cuda_graphs():
    from harness.servers import SGLANG_EXTRA_ARGS
    assert "--disable-cuda-graph" not in SGLANG_EXTRA_ARGS


def test_every_field_declares_its_rule():
    for section in dataclasses.fields(Config):
        cls = section.default_factory
        assert cls.__name__.removesuffix("Config").lower() == section.name  # the name its errors use
        missing = [f.name for f in dataclasses.fields(cls) if "rule" not in f.metadata]
        assert not missing, f"[{section.name}] fields without a rule: {missing}"


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
    replica = engine_command(load_config(overrides=[f"--model.path={tmp_path}", "--engine.port=1234",
                                                    "--engine.replicas=3"]), replica=2)
    assert replica[replica.index("--port") + 1] == "1236"


def test_sglang_gets_the_configured_share_of_its_whole_gpu():
    """SGLang 0.5.16 takes --mem-fraction-static of the memory free as its model loads: the launcher passes
    the value that gives it engine.mem_fraction_static of the whole GPU whatever else holds memory there,
    and refuses in one line when that much is not free."""
    from nano_miles.engine.launch import GIB
    from nano_miles.run.cli import UserError
    cfg = load_config(overrides=["--engine.kind=sglang", "--engine.mem_fraction_static=0.3"])

    def flag(free_gib: float) -> float:
        argv = engine_command(cfg, 0, (int(free_gib * GIB), 80 * GIB))
        return float(argv[argv.index("--mem-fraction-static") + 1])
    assert flag(80) == 0.3
    assert flag(53) * 53 == pytest.approx(24, abs=0.01)  # beside a trainer holding 27 GiB: still 24 GiB
    with pytest.raises(UserError, match=r"asks 24.0 GiB of GPU 0 \(80.0 GiB\), and 25.0 GiB is free"):
        flag(25)  # 24 GiB would leave SGLang too little beside its share
    argv = engine_command(cfg)  # as --print shows it: the config's value
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.3"


def test_a_gpu_memory_read_where_there_is_none_is_one_line():
    """The launcher reads SGLang's GPU in a child process; where torch sees no such GPU, its error is the line."""
    import torch

    from nano_miles.engine.launch import gpu_memory
    from nano_miles.run.cli import UserError
    if torch.cuda.is_available():
        free, total = gpu_memory(0)
        assert 0 < free <= total
        return
    with pytest.raises(UserError, match=r"^cannot read the memory of GPU 0: \w+Error: ") as e:
        gpu_memory(0)
    assert "\n" not in str(e.value) and "[" not in str(e.value)


def test_router_command_line():
    from nano_miles.engine.launch import router_command
    cmd = router_command(load_config(overrides=["--engine.replicas=2", "--engine.port=1234",
                                                "--engine.router_port=2000"]))
    assert cmd[1:3] == ["-m", "sglang_router.launch_router"] and cmd[cmd.index("--port") + 1] == "2000"
    urls = cmd[cmd.index("--worker-urls") + 1:]
    assert urls[:2] == ["http://127.0.0.1:1234", "http://127.0.0.1:1235"] and urls[2].startswith("--")


@pytest.mark.parametrize("slot", [["--replica=1"], ["--replica=3", "--engine.replicas=3"], ["--router"]])
def test_an_unused_slot_says_so_and_exits_0(slot):
    import subprocess
    result = subprocess.run([*proc_command("engine"), *slot], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and "is not used: engine.replicas = " in result.stdout, result


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_sglang_gets_the_configured_dtype(tmp_path, dtype):
    sg = engine_command(load_config(overrides=[f"--model.path={tmp_path}", "--engine.kind=sglang",
                                               f"--engine.dtype={dtype}"]))
    assert sg[sg.index("--dtype") + 1] == dtype


def test_entry_point_rejects_a_model_path_without_a_model(tmp_path):
    import subprocess
    result = subprocess.run([*proc_command("engine"), f"--model.path={tmp_path}",
                             "--print"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "model.path" in result.stderr and "config.json" in result.stderr
    result = subprocess.run([*proc_command("engine"), f"--model.path={DEFAULT_POLICY_DIR}",
                             "--print"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and str(DEFAULT_POLICY_DIR) in result.stdout


@pytest.mark.parametrize("preset", [None, "true"])
def test_sglang_health_checks_do_not_generate(preset):
    """SGLang's /health would hold the weight-update lock for up to a second (launch.engine_env); a
    value the user set wins. The local engine gets no such variable."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"}
    if preset:
        env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = preset
    printed = {kind: subprocess.run([*proc_command("engine"), f"--model.path={DEFAULT_POLICY_DIR}",
                                     f"--engine.kind={kind}", "--print"], env=env, capture_output=True, text=True,
                                    timeout=60).stdout.split()
               for kind in ("sglang", "local")}
    assert printed["sglang"][0] == f"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION={preset or 'false'}", printed
    assert printed["local"][0] == sys.executable, printed


def test_the_built_in_defaults_are_configs_default_toml(tmp_path, monkeypatch):
    """Outside a checkout (no configs/default.toml in the working directory: an installed package used
    elsewhere) the built-in defaults apply, and they are exactly what configs/default.toml spells out;
    relative paths are the working directory's, and the shipped policy is found inside the package."""
    monkeypatch.delenv("NANOMILES_CONFIG", raising=False)
    monkeypatch.delenv("NANOMILES_OVERRIDES", raising=False)
    monkeypatch.chdir(REPO_ROOT)
    in_checkout = load_config().to_dict()
    monkeypatch.chdir(tmp_path)
    elsewhere = load_config()
    assert elsewhere.to_dict() == in_checkout
    assert elsewhere.run_dir == tmp_path / "runs" / "current"
    assert (elsewhere.model_dir / "config.json").is_file() and "nano_miles" in elsewhere.model_dir.parts


def test_the_hang_timeout_outlasts_the_trainers_control_tries():
    """The trainer's loop does not beat while a control call retries: a hang timeout within that
    restarted the trainer when the producer hung, instead of the producer."""
    with pytest.raises(ConfigError, match=r"run.hang_timeout_s must be 0 \(off\) or above .* = 30 s, not 8"):
        load_config(overrides=["--run.hang_timeout_s=8"])  # default control: 5 s x 6 tries
    load_config(overrides=["--run.hang_timeout_s=8", "--trainer.control_timeout_s=2", "--trainer.control_retries=3"])
    load_config(overrides=["--run.hang_timeout_s=0"])


def test_gpu_engines_share_the_trainers_gpus_or_take_their_own_after_them():
    def layout(*overrides, replicas=4):
        cfg = load_config(overrides=["--engine.kind=sglang", f"--engine.replicas={replicas}", *overrides])
        return [cfg.engine_gpu(k) for k in range(replicas)]
    fsdp2 = ["--trainer.device=cuda", "--trainer.strategy=fsdp2", "--trainer.world_size=2"]
    assert layout("--trainer.device=cuda") == [0, 0, 0, 0]  # one GPU for everything, the default
    assert layout(*fsdp2) == [0, 1, 0, 1]                    # colocated: the trainer's GPUs in turn
    assert layout("--trainer.device=cuda:1") == [1, 1, 1, 1]
    assert layout("--trainer.device=cuda", "--engine.colocate=false") == [1, 2, 3, 4]
    assert layout(*fsdp2, "--engine.colocate=false", replicas=2) == [2, 3]
    assert layout("--engine.colocate=false") == [0, 1, 2, 3]  # a CPU trainer holds no GPU
    cfg = load_config(overrides=[*fsdp2, "--engine.kind=sglang", "--engine.replicas=2", "--engine.colocate=false"])
    argv = engine_command(cfg, replica=1)
    assert argv[argv.index("--base-gpu-id") + 1] == "3"
    local = engine_command(load_config(overrides=[*fsdp2, "--engine.device=cuda", "--engine.colocate=false"]))
    assert local[local.index("--device") + 1] == "cuda:2"
    local = engine_command(load_config(overrides=fsdp2))  # the local engine on the CPU stays there
    assert local[local.index("--device") + 1] == "cpu" and "--base-gpu-id" not in local


def test_an_nccl_weight_group_keeps_the_engines_off_the_trainers_gpu():
    nccl = ["--engine.kind=sglang", "--trainer.device=cuda", "--engine.weight_transport=distributed",
            "--engine.weight_group_backend=nccl"]
    with pytest.raises(ConfigError, match=r'^engine.weight_group_backend = "nccl" cannot join the trainer and an '
                                          r"engine on one GPU \(engine.colocate = true puts engine 0 on the trainer's GPU 0\)"):
        load_config(overrides=nccl)
    load_config(overrides=[*nccl, "--engine.colocate=false"])
    load_config(overrides=[*nccl[:-1], "--engine.weight_group_backend=gloo"])  # gloo shares a GPU
    load_config(overrides=[*nccl, '--engine.urls=["http://h:1"]'])  # engines elsewhere: their own GPUs


def test_an_engine_laid_out_on_a_gpu_the_host_lacks_is_one_line(tmp_path):
    import subprocess

    import torch

    from harness.servers import free_port
    if torch.cuda.device_count() > 2:
        pytest.skip("this host has the GPU the layout names")
    result = subprocess.run([*proc_command("engine"), "--engine.device=cuda", "--trainer.device=cuda",
                             "--trainer.strategy=fsdp2", "--trainer.world_size=2", "--engine.colocate=false",
                             f"--engine.port={free_port()}", f"--run.dir={tmp_path}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result
    visible = {0: "no GPUs are", 1: "1 GPU is", 2: "2 GPUs are"}[torch.cuda.device_count()]
    assert result.stderr.strip().endswith(f"engine 0 needs GPU 2, but {visible} visible (engine.colocate = false "
                                          "puts the engines on GPUs after the trainer's)"), result.stderr
