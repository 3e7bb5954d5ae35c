"""The run configuration: one TOML file read by every process, `--section.key=value` overrides on top.

`python -m nano_miles.run.config [--config FILE] [--section.key=value ...]` prints the merged config.

Layering, lowest first: the dataclass defaults below, the TOML file (`configs/default.toml` unless
`--config` or $NANOMILES_CONFIG names another), overrides from $NANOMILES_OVERRIDES (space separated;
how supervisord-launched stages get per-run settings), then command-line overrides. Each process reads
the whole file and uses its own section; unknown sections or keys are errors, never silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from nano_miles.run.cli import ArgumentParser, UserError, run
from nano_miles.wire.control import PAUSE_MODES

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.toml"
DEFAULT_POLICY_DIR = REPO_ROOT / "nano_miles" / "assets" / "policy"  # the shipped small policy


class ConfigError(UserError):
    """A config file or override that cannot be used; the message names the key."""


@dataclass
class RunConfig:
    dir: str = "runs/current"        # run directory (relative paths are relative to the repo root)
    seed: int = 0
    mode: str = "sync"               # "sync": on-policy, staleness 0; "async": bounded staleness
    max_staleness: int = 0           # async only: samples older than this many versions are dropped
    pause_mode: str = "abort"        # engine pause at a weight update: abort (in-flight samples come
                                     # back partial and are resumed), retract or in_place (kept)

    def __post_init__(self):
        if self.mode not in ("sync", "async"):
            raise ConfigError(f"run.mode must be 'sync' or 'async', not {self.mode!r}")
        if self.pause_mode not in PAUSE_MODES:
            raise ConfigError(f"run.pause_mode must be one of {', '.join(PAUSE_MODES)}, not {self.pause_mode!r}")
        if self.max_staleness < 0:
            raise ConfigError("run.max_staleness must be >= 0")

    @property
    def effective_max_staleness(self) -> int:
        """The bound both the producer's version gate and the trainer's stale-drop use: sync is 0."""
        return self.max_staleness if self.mode == "async" else 0


@dataclass
class ModelConfig:
    path: str = ""                   # a local HF model directory; empty = the shipped small policy


@dataclass
class EngineConfig:
    kind: str = "local"              # "local" (transformers + torch) or "sglang" (GPU)
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int = 1             # torch threads of the local engine
    mem_fraction_static: float = 0.5 # sglang: share of GPU memory for weights + KV (trainer needs the rest)
    extra_args: str = ""             # sglang: more server flags, shell-split (e.g. "--attention-backend triton")
    request_timeout_s: float = 300.0
    weight_transport: str = "tensor" # "tensor": shared memory / CUDA IPC (same host as the trainer);
                                     # "distributed": broadcast over a gloo/nccl group (any host)
    weight_group_backend: str = "gloo"          # "nccl" for GPU engines
    weight_group_address: str = "127.0.0.1"     # trainer's address as the engines reach it
    weight_group_port: int = 0                  # 0 = a free local port (single host only)
    weight_group_timeout_s: float = 120.0
    urls: list = field(default_factory=list)    # several engines: ["http://h1:30000", ...]; [] = host:port
    router_url: str = ""             # sglang-router in front of `urls`: generation goes through it

    def __post_init__(self):
        if self.kind not in ("local", "sglang"):
            raise ConfigError(f"engine.kind must be 'local' or 'sglang', not {self.kind!r}")
        if self.weight_transport not in ("tensor", "distributed"):
            raise ConfigError(f"engine.weight_transport must be 'tensor' or 'distributed', "
                              f"not {self.weight_transport!r}")
        if self.weight_group_backend not in ("gloo", "nccl"):
            raise ConfigError("engine.weight_group_backend must be 'gloo' or 'nccl'")
        if not isinstance(self.urls, list) or not all(isinstance(u, str) and u.startswith("http://")
                                                      for u in self.urls):
            raise ConfigError('engine.urls must be a list of "http://host:port" strings')
        if len(self.urls) > 1 and not self.router_url:
            raise ConfigError("engine.urls lists several engines: set engine.router_url for generation")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def engine_urls(self) -> list[str]:
        """Every engine that takes control calls and weight updates."""
        return list(self.urls) or [self.url]


@dataclass
class TaskConfig:
    name: str = "nano_miles.tasks.arithmetic"
    num_train: int = 20000
    num_test: int = 200
    seed: int = 0


@dataclass
class RolloutConfig:
    group_size: int = 8              # G samples per prompt
    max_new_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    control_endpoint: str = "tcp://127.0.0.1:5701"   # REP, bound by the rollout producer
    max_inflight_groups: int = 16
    lease_s: float = 60.0            # a group sent but not trained for this long is issued again
    metrics_port: int = 9101

    def __post_init__(self):
        if self.group_size < 1 or self.max_new_tokens < 1:
            raise ConfigError("rollout.group_size and rollout.max_new_tokens must be >= 1")


@dataclass
class RewardConfig:
    fn: str = "nano_miles.tasks.arithmetic:reward"
    endpoint: str = "tcp://127.0.0.1:5702"          # PULL, bound by the reward stage
    timeout_s: float = 5.0                          # per-sample budget of the reward function
    metrics_port: int = 9102


@dataclass
class TrainerConfig:
    num_steps: int = 240
    batch_groups: int = 16           # groups (prompts) per optimizer step
    lr: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    dual_clip_c: float = 3.0
    recompute_old_logprobs: bool = False  # pi_old from the trainer (+ truncated IS to the engine's)
    tis_clip: float = 2.0            # truncation of the importance weight pi_old / pi_engine
    endpoint: str = "tcp://127.0.0.1:5703"          # PULL, bound by the trainer
    device: str = "cpu"
    num_threads: int = 1
    eval_every: int = 20             # held-out greedy evaluation every N steps (0 = only at the end)
    checkpoint_every: int = 20
    control_timeout_s: float = 5.0   # Lazy Pirate: per-try timeout on the control channel
    control_retries: int = 6
    metrics_port: int = 9103

    def __post_init__(self):
        if self.num_steps < 1 or self.batch_groups < 1:
            raise ConfigError("trainer.num_steps and trainer.batch_groups must be >= 1")


@dataclass
class MetricsConfig:
    tensorboard: bool = False        # step scalars as TensorBoard events in <run dir>/tensorboard
    wandb_project: str = ""          # step scalars to Weights & Biases under this project; "" = off
    plots: bool = True               # PNG plots into the run dir at the end (needs matplotlib)
    queue_sample_s: float = 1.0      # trainer samples queue depths into queues.jsonl this often; 0 = never


@dataclass
class SecurityConfig:
    curve_dir: str = ""              # ZeroMQ CURVE keys from `python -m nano_miles.run.keys DIR`; "" = plain


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)

    @property
    def run_dir(self) -> Path:
        p = Path(self.run.dir)
        return p if p.is_absolute() else REPO_ROOT / p

    @property
    def model_dir(self) -> Path:
        """The policy every stage loads: `model.path`, or the small policy shipped in the package."""
        return Path(self.model.path) if self.model.path else DEFAULT_POLICY_DIR

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The merged config as TOML (the run directory keeps this copy)."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{k} = {_toml_scalar(v)}" for k, v in values.items()]
            lines.append("")
        return "\n".join(lines)


def _toml_scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    return repr(value)


def _parse_value(text: str):
    """TOML scalar if it parses as one (numbers, booleans, quoted strings, lists), else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _coerce(section: str, key: str, value, default):
    where = f"{section}.{key}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, not {value!r}")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, not {value!r}")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, not {value!r}")
        value = float(value)
    elif isinstance(default, str) and not isinstance(value, str):
        value = str(value)
    return value


def _apply(raw: dict[str, dict], table: dict, origin: str) -> None:
    for section, values in table.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{origin}: [{section}] must be a table")
        raw.setdefault(section, {}).update(values)


def parse_overrides(args: list[str]) -> dict[str, dict]:
    """['--trainer.lr=1e-3', ...] -> {'trainer': {'lr': 0.001}}."""
    table: dict[str, dict] = {}
    for arg in args:
        body = arg[2:] if arg.startswith("--") else arg
        if "=" not in body or "." not in body.split("=", 1)[0]:
            raise ConfigError(f"override {arg!r} must look like --section.key=value")
        dotted, text = body.split("=", 1)
        section, key = dotted.split(".", 1)
        table.setdefault(section, {})[key] = _parse_value(text)
    return table


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Merge defaults, the TOML file, $NANOMILES_OVERRIDES and `overrides`; validate every key."""
    path = Path(path or os.environ.get("NANOMILES_CONFIG") or DEFAULT_CONFIG)
    try:
        file_table = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    raw: dict[str, dict] = {}
    _apply(raw, file_table, str(path))
    _apply(raw, parse_overrides(shlex.split(os.environ.get("NANOMILES_OVERRIDES", ""))),
           "$NANOMILES_OVERRIDES")
    _apply(raw, parse_overrides(overrides or []), "command line")
    built = {}
    for f in dataclasses.fields(Config):
        default = f.default_factory()
        values = raw.pop(f.name, {})
        defaults = {k.name: getattr(default, k.name) for k in dataclasses.fields(default)}
        unknown = set(values) - set(defaults)
        if unknown:
            raise ConfigError(f"unknown key(s) in [{f.name}]: {', '.join(sorted(unknown))} "
                              f"(known: {', '.join(defaults)})")
        built[f.name] = type(default)(**{k: _coerce(f.name, k, v, defaults[k]) for k, v in values.items()})
    if raw:
        raise ConfigError(f"unknown section(s): {', '.join(sorted(raw))} (known: {', '.join(built)})")
    return Config(**built)


def is_override(arg: str) -> bool:
    """`--section.key=value` (a dot in the flag's name), as opposed to an entry point's own flags."""
    return arg.startswith("--") and "." in arg.split("=", 1)[0]


def parse_config(argv: list[str], parser: argparse.ArgumentParser) -> tuple[Config, argparse.Namespace]:
    """What every entry point that reads the config does first: `--config FILE` and the overrides make
    the Config, every other flag goes through `parser` (which also answers --help). A mistake in any
    of them raises a UserError naming it (ConfigError is one)."""
    parser.add_argument("--config", metavar="FILE",
                        help="the TOML file (default: $NANOMILES_CONFIG, else configs/default.toml)")
    parser.epilog = ("--section.key=value overrides one key of the config, e.g. --trainer.lr=1e-3\n"
                     "(python -m nano_miles.run.config prints the merged config)")
    args, unknown = parser.parse_known_args([a for a in argv if not is_override(a)])
    # overrides first: in `--trainer.lr 1e-3` the flag is the mistake to name, not the stray value
    cfg = load_config(args.config, [a for a in argv if is_override(a)])
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    check_paths(cfg)
    return cfg, args


def check_paths(cfg: Config) -> None:
    """Paths a stage would trip over later, looked up on disk (the sections check values only, so a
    config can be built and printed on a machine without them)."""
    if not (cfg.model_dir / "config.json").is_file():
        raise ConfigError(f"model.path {str(cfg.model_dir)!r} is not a local HF model directory "
                          "(no config.json there)")
    if cfg.security.curve_dir and not (Path(cfg.security.curve_dir) / "allowed").is_dir():
        raise ConfigError(f"security.curve_dir {cfg.security.curve_dir!r} holds no CURVE keys "
                          "(python -m nano_miles.run.keys DIR makes them)")


def main(argv: list[str]) -> int:
    cfg, _ = parse_config(argv, ArgumentParser(prog="python -m nano_miles.run.config", description=__doc__))
    print(cfg.to_toml())
    return 0


if __name__ == "__main__":
    run(main, "config")
