"""The run configuration: one TOML file read by every process, `--section.key=value` overrides on top.

`python -m nano_miles.run.config [--config FILE] [--section.key=value ...]` prints the merged config.

Layering, lowest first: the sections' defaults (`sections.py`), the TOML file (`configs/default.toml` unless
`--config` or $NANOMILES_CONFIG names another), overrides from $NANOMILES_OVERRIDES (space separated;
how supervisord-launched stages get per-run settings), then command-line overrides. Each process reads
the whole file and uses its own section; unknown sections or keys are errors, never silently ignored.
Every field declares what it accepts next to its default (`sections.py`, with `rules.py`): a value out of range is an
error at the process's start, naming the key, not a failure later inside a stage. `values.py` reads
a value as its field's type; `paths.py` looks up on disk the paths the stages will need.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from nano_miles.run.cli import ArgumentParser, run
from nano_miles.run.paths import check_paths
from nano_miles.run.sections import (EngineConfig, MetricsConfig, ModelConfig, RewardConfig, RolloutConfig, RunConfig,
                                     SecurityConfig, TaskConfig, TrainerConfig)
from nano_miles.run.values import ConfigError, coerce, merge, parse_overrides, toml_scalar

# Relative paths are the working directory's, as for any command: supervisord runs every stage in the
# checkout (`directory=%(here)s`). Without `configs/default.toml` there (an installed package used from
# elsewhere) the built-in defaults apply; that file spells them out, and tests/test_config.py keeps the two equal.
DEFAULT_CONFIG = Path("configs") / "default.toml"
DEFAULT_POLICY_DIR = Path(__file__).resolve().parents[1] / "assets" / "policy"  # the shipped small policy


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
    set_keys = frozenset()  # "section.key"s the user chose, filled by load_config (not a field: never dumped)

    def is_set(self, dotted: str) -> bool:
        """Whether `section.key` is the user's choice rather than its default applying: a value other
        than the default, or the default itself named in a config file other than configs/default.toml
        (which spells out the defaults) or by an override."""
        section, key = dotted.split(".", 1)
        f = next(f for f in dataclasses.fields(getattr(self, section)) if f.name == key)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        return dotted in self.set_keys or getattr(getattr(self, section), key) != default

    def __post_init__(self):  # rules between sections
        # The trainer's loop does not beat while a control call retries: a hang timeout within that
        # would restart the trainer when the producer hangs (silent itself, the one to restart).
        blocked_s = self.trainer.control_timeout_s * self.trainer.control_retries
        if 0 < self.run.hang_timeout_s <= blocked_s:
            raise ConfigError(f"run.hang_timeout_s must be 0 (off) or above trainer.control_timeout_s x "
                              f"trainer.control_retries = {blocked_s:g} s, not {self.run.hang_timeout_s:g}")
        uses_overlong = any(f.startswith("nano_miles.rewards.overlong") for f in [self.reward.fn, *self.reward.fns])
        if uses_overlong and self.reward.overlong_buffer > self.rollout.max_new_tokens:
            raise ConfigError(f"reward.overlong_buffer ({self.reward.overlong_buffer}) is longer than "
                              f"rollout.max_new_tokens ({self.rollout.max_new_tokens}): the penalty's ramp ends there")
        num_samples = self.trainer.batch_groups * self.rollout.group_size
        if self.trainer.mini_batches > num_samples:
            raise ConfigError(f"trainer.mini_batches ({self.trainer.mini_batches}) is more than a step's "
                              f"{num_samples} samples (trainer.batch_groups x rollout.group_size)")

        e = self.engine  # NCCL refuses a group with two members on one GPU: rank 0 and engine 0 here
        if (e.weight_transport, e.weight_group_backend, e.colocate) == ("distributed", "nccl", True) \
                and self.engine_gpus_here and self.trainer_gpus:
            raise ConfigError(f"engine.weight_group_backend = \"nccl\" cannot join the trainer and an engine on one GPU "
                              f"(engine.colocate = true puts engine 0 on the trainer's GPU {self.trainer_gpus[0]}): "
                              "set engine.colocate = false (a GPU per engine) or engine.weight_transport = \"tensor\"")

    @property
    def trainer_gpus(self) -> list[int]:
        """The GPUs the trainer runs on (indexes among the visible ones): a rank per GPU from 0 under
        fsdp2, else the one trainer.device names; none on the CPU."""
        device = self.trainer.device
        if not device.startswith("cuda"):
            return []
        if self.trainer.strategy == "fsdp2":
            return list(range(self.trainer.world_size))
        return [int(device.partition(":")[2] or 0)]

    @property
    def engine_gpus_here(self) -> bool:
        """Are the engines this config starts on GPUs (SGLang, or the local engine on cuda)?"""
        return not self.engine.urls and (self.engine.kind == "sglang" or self.engine.device == "cuda")

    def engine_gpu(self, replica: int) -> int:
        """The GPU engine `replica` starts on. Colocated (the default), the engines take the trainer's
        GPUs in turn (all of them GPU 0 for a one-GPU trainer); otherwise each has one of its own, after
        the trainer's, as in miles (trainer 0..N-1, engines N, N+1, ...)."""
        gpus = self.trainer_gpus
        if self.engine.colocate:
            return gpus[replica % len(gpus)] if gpus else 0
        return (max(gpus) + 1 if gpus else 0) + replica

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir).absolute()

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
            lines += [f"{k} = {toml_scalar(v)}" for k, v in values.items()]
            lines.append("")
        return "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Merge defaults, the TOML file, $NANOMILES_OVERRIDES and `overrides`; validate every key."""
    path = Path(path or os.environ.get("NANOMILES_CONFIG") or DEFAULT_CONFIG)
    try:
        is_builtin = path == DEFAULT_CONFIG and not path.is_file()
        file_table = {} if is_builtin else tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:  # a directory, a file it may not read, text not UTF-8
        raise ConfigError(f"config file {path} cannot be read as text ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    try:
        env_overrides = shlex.split(os.environ.get("NANOMILES_OVERRIDES", ""))
    except ValueError as e:  # an unclosed quote
        raise ConfigError(f"$NANOMILES_OVERRIDES does not split into words ({e})") from None
    raw: dict[str, dict] = {}
    set_keys = merge(raw, file_table, str(path))
    if path.resolve() == DEFAULT_CONFIG.resolve():
        set_keys = set()  # the defaults spelled out: not the user's choice
    set_keys |= merge(raw, parse_overrides(env_overrides), "$NANOMILES_OVERRIDES")
    set_keys |= merge(raw, parse_overrides(overrides or []), "command line")
    built = {}
    for f in dataclasses.fields(Config):
        default = f.default_factory()
        values = raw.pop(f.name, {})
        defaults = {k.name: getattr(default, k.name) for k in dataclasses.fields(default)}
        unknown = set(values) - set(defaults)
        if unknown:
            raise ConfigError(f"unknown key(s) in [{f.name}]: {', '.join(sorted(unknown))} "
                              f"(known: {', '.join(defaults)})")
        built[f.name] = type(default)(**{k: coerce(f.name, k, v, defaults[k]) for k, v in values.items()})
    if raw:
        raise ConfigError(f"unknown section(s): {', '.join(sorted(raw))} (known: {', '.join(built)})")
    cfg = Config(**built)
    cfg.set_keys = frozenset(set_keys)
    return cfg


def is_override(arg: str) -> bool:
    """`--section.key=value` (a dot in the flag's name), as opposed to an entry point's own flags."""
    return arg.startswith("--") and "." in arg.split("=", 1)[0]


def parse_config(argv: list[str], parser: argparse.ArgumentParser, *,
                 needs_tokenizer: bool = True) -> tuple[Config, argparse.Namespace]:
    """What every entry point that reads the config does first: `--config FILE` and the overrides make
    the Config, every other flag goes through `parser` (which also answers --help), the paths are
    looked up (`paths.check_paths`). A mistake in any of them raises a UserError naming it."""
    parser.add_argument("--config", metavar="FILE",
                        help="the TOML file (default: $NANOMILES_CONFIG, else configs/default.toml)")
    parser.epilog = ("--section.key=value overrides one key of the config, e.g. --trainer.lr=1e-3\n"
                     "(python -m nano_miles.run.config prints the merged config)")
    args, unknown = parser.parse_known_args([a for a in argv if not is_override(a)])
    # overrides first: in `--trainer.lr 1e-3` the flag is the mistake to name, not the stray value
    cfg = load_config(args.config, [a for a in argv if is_override(a)])
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    check_paths(cfg, needs_tokenizer=needs_tokenizer)
    return cfg, args


def main(argv: list[str]) -> int:
    cfg, _ = parse_config(argv, ArgumentParser(prog="python -m nano_miles.run.config", description=__doc__))
    print(cfg.to_toml())
    return 0


if __name__ == "__main__":
    run(main, "config")
