"""The run configuration: one TOML file read by every process, `--section.key=value` overrides on top.

`python -m nano_miles.run.config [--config FILE] [--section.key=value ...]` prints the merged config.

Layering, lowest first: the dataclass defaults below, the TOML file (`configs/default.toml` unless
`--config` or $NANOMILES_CONFIG names another), overrides from $NANOMILES_OVERRIDES (space separated;
how supervisord-launched stages get per-run settings), then command-line overrides. Each process reads
the whole file and uses its own section; unknown sections or keys are errors, never silently ignored.
Every field declares what it accepts next to its default (`rules.py`): a value out of range is an
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
from nano_miles.run.rules import (ANY_TEXT, BOOL, DEVICE, ENDPOINT, FRACTION, FUNCTION, FUNCTIONS, HOST, MODULE,
                                  NON_EMPTY, NUMBERS, OPEN_FRACTION, PORT, PORT_OR_FREE, SHELL_WORDS, TOP_K,
                                  URL_OR_EMPTY, URLS, Section, above, at_least, between, checked, one_of)
from nano_miles.run.values import ConfigError, coerce, merge, parse_overrides, toml_scalar
from nano_miles.wire.control import PAUSE_MODES

# Relative paths are the working directory's, as for any command: supervisord runs every stage in the
# checkout (`directory=%(here)s`). Without `configs/default.toml` there (an installed package used from
# elsewhere) the built-in defaults apply; that file spells them out, and tests/test_config.py keeps the two equal.
DEFAULT_CONFIG = Path("configs") / "default.toml"
DEFAULT_POLICY_DIR = Path(__file__).resolve().parents[1] / "assets" / "policy"  # the shipped small policy


DTYPES = ("float32", "bfloat16", "float16")  # what SGLang and torch both name so
LOCAL_ENGINE_DTYPES = ("float32", "bfloat16")  # python -m nano_miles.local_engine --dtype
TRAIN_DTYPES = ("float32", "bfloat16")  # the trainer's compute dtype; weights stay fp32 either way
LR_SCHEDULES = ("constant", "cosine")
# the names nano_miles/algo picks its functions by (tests/test_config.py holds them equal; the config
# needs no torch, so it keeps its own copy)
ADVANTAGES = ("grpo", "rloo", "reinforce_pp")
REWARD_SCALES = ("group", "batch", "none")
LOSSES = ("dapo", "grpo", "dr_grpo", "gspo", "gspo_token", "cispo")
KL_ESTIMATORS = ("k1", "k2", "k3")
MAX_REPLICAS = 4  # engine slots in supervisord.conf (engine + [program:replica] numprocs); unused slots exit


@dataclass
class RunConfig(Section):
    dir: str = checked("runs/current", NON_EMPTY)     # run directory (relative to the repo root)
    seed: int = checked(0, at_least(0))
    mode: str = checked("sync", one_of("sync", "async"))  # sync: on-policy, staleness 0; async: bounded
    max_staleness: int = checked(0, at_least(0))      # async only (sync refuses > 0): samples this many versions
                                                      # older are dropped
    pause_mode: str = checked("abort", one_of(*PAUSE_MODES))  # engine pause at a weight update: abort (in-flight
                                                      # samples come back partial, are resumed), retract, in_place
    hang_timeout_s: float = checked(120.0, at_least(0))  # restart a stage whose loop is this long silent (0: never)

    def __post_init__(self):
        super().__post_init__()
        if self.mode == "sync" and self.max_staleness:
            raise ConfigError(f"run.max_staleness = {self.max_staleness} bounds the staleness of run.mode=async; "
                              "sync is on-policy (staleness 0): set run.mode=async, or leave max_staleness 0")

    @property
    def effective_max_staleness(self) -> int:
        """The bound both the producer's version gate and the trainer's stale-drop use: sync is 0."""
        return self.max_staleness if self.mode == "async" else 0


@dataclass
class ModelConfig(Section):
    path: str = checked("", ANY_TEXT)  # a local HF model directory; empty = the shipped small policy


@dataclass
class EngineConfig(Section):
    kind: str = checked("local", one_of("local", "sglang"))  # local: transformers + torch; sglang: GPU
    host: str = checked("127.0.0.1", HOST)
    port: int = checked(30000, PORT)
    device: str = checked("cpu", DEVICE)  # the local engine's; SGLang picks its GPU itself
    dtype: str = checked("float32", one_of(*DTYPES))
    num_threads: int = checked(1, at_least(1))        # torch threads of the local engine
    mem_fraction_static: float = checked(0.5, FRACTION)  # sglang: GPU share for weights + KV (rest: trainer)
    extra_args: str = checked("", SHELL_WORDS)        # sglang: more server flags, shell-split
                                                      # (e.g. "--attention-backend triton")
    request_timeout_s: float = checked(300.0, above(0))
    weight_transport: str = checked("tensor", one_of("tensor", "distributed"))  # tensor: shared memory or
                                                      # CUDA IPC (same host); distributed: a gloo/nccl group (any host)
    weight_group_backend: str = checked("gloo", one_of("gloo", "nccl"))  # nccl for GPU engines
    weight_group_address: str = checked("127.0.0.1", HOST)  # trainer's address as the engines reach it
    weight_group_port: int = checked(0, PORT_OR_FREE)       # 0 = a free local port (single host only)
    weight_group_timeout_s: float = checked(120.0, above(0))
    replicas: int = checked(1, between(1, MAX_REPLICAS, "the engine slots of supervisord.conf"))  # engines
                                                      # started here on ports port, port+1, ...; > 1: behind
                                                      # sglang-router at router_port
    router_port: int = checked(30100, PORT)           # the router supervisord starts when replicas > 1
    urls: list = checked([], URLS)   # engines started elsewhere: ["http://h1:30000", ...]; [] = the replicas
    router_url: str = checked("", URL_OR_EMPTY)       # sglang-router in front of `urls`: generation goes through it

    def __post_init__(self):
        super().__post_init__()
        if self.replicas > 1 and (self.urls or self.router_url):
            raise ConfigError("engine.replicas starts engines here, engine.urls names engines started elsewhere: "
                              "set one of them")
        if self.kind == "local" and self.dtype not in LOCAL_ENGINE_DTYPES:
            self.refuse("dtype", f"{' or '.join(LOCAL_ENGINE_DTYPES)} with engine.kind=local", self.dtype)
        if self.kind == "local" and self.device not in ("cpu", "cuda"):  # CUDA_VISIBLE_DEVICES picks the GPU
            self.refuse("device", "cpu or cuda with engine.kind=local", self.device)
        if len(self.urls) > 1 and not self.router_url:
            raise ConfigError("engine.urls lists several engines: set engine.router_url for generation")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def engine_urls(self) -> list[str]:
        """Every engine that takes control calls and weight updates."""
        return list(self.urls) or [f"http://{self.host}:{self.port + i}" for i in range(self.replicas)]

    @property
    def generation_url(self) -> str:
        """Where generation goes: the router in front of several engines, else the one engine ("")."""
        return self.router_url or (f"http://{self.host}:{self.router_port}" if self.replicas > 1 else "")


@dataclass
class TaskConfig(Section):
    name: str = checked("nano_miles.tasks.arithmetic", MODULE)  # imported, and its size checked, at stage start
                                                      # (nano_miles.tasks.files: a user's data file)
    num_train: int = checked(0, at_least(0))          # the first N train problems; 0 = all
    num_test: int = checked(200, at_least(0))         # held-out problems evaluated; 0 = all (a file task:
                                                      # all of test_file; without one, > 0 of train_file)
    seed: int = checked(0, at_least(0))               # arithmetic: which problems (files: run.seed shuffles)
    train_file: str = checked("", ANY_TEXT)           # files: .jsonl, .json, .parquet or a datasets directory
    test_file: str = checked("", ANY_TEXT)            # files: held-out data; "" = a fixed slice of train_file
    prompt_key: str = checked("prompt", NON_EMPTY)    # files: the prompt's key (dotted for nested records)
    label_key: str = checked("label", NON_EMPTY)      # files: the label's key, handed to the reward function
    chat_template: bool = checked(False, BOOL)        # render prompts with the tokenizer's chat template
    system_prompt: str = checked("", ANY_TEXT)        # with chat_template: a system turn before every prompt

    def __post_init__(self):  # keys their task or mode would ignore: refused, not dropped in silence
        super().__post_init__()
        if self.system_prompt and not self.chat_template:
            raise ConfigError("task.system_prompt is a turn of the chat template: set task.chat_template=true")
        if self.name == "nano_miles.tasks.arithmetic" and (self.train_file or self.test_file):
            raise ConfigError(f"task.{'train' if self.train_file else 'test'}_file is data for task.name="
                              "nano_miles.tasks.files; the arithmetic task (the default task.name) makes its own")


@dataclass
class RolloutConfig(Section):
    fn: str = checked("nano_miles.rollouts.single_turn:rollout", FUNCTION)  # a group's rollout (nano_miles/rollouts)
    group_size: int = checked(8, at_least(1))         # G samples per prompt
    max_new_tokens: int = checked(48, at_least(1))    # a sample's tokens after the prompt, every turn's
    max_turns: int = checked(4, at_least(1))          # the model's turns in a multi-turn rollout (tools)
    temperature: float = checked(1.0, at_least(0))    # 0 = greedy
    top_p: float = checked(1.0, FRACTION)
    top_k: int = checked(-1, TOP_K)
    control_endpoint: str = checked("tcp://127.0.0.1:5701", ENDPOINT)  # REP, bound by the rollout producer
    max_inflight_groups: int = checked(16, at_least(1))
    lease_s: float = checked(60.0, above(0))          # a group sent but not trained for this long is issued again
    metrics_port: int = checked(9101, PORT_OR_FREE)


@dataclass
class RewardConfig(Section):
    fn: str = checked("nano_miles.tasks.arithmetic:reward", FUNCTION)  # imported at stage start
    fns: list = checked([], FUNCTIONS)                # several functions, summed with `weights`; [] = `fn` alone
    weights: list = checked([], NUMBERS)              # one per function of `fns`; [] = all 1.0
    endpoint: str = checked("tcp://127.0.0.1:5702", ENDPOINT)  # PULL, bound by the reward stage
    timeout_s: float = checked(5.0, above(0))         # per-sample budget of the reward function
    num_workers: int = checked(4, at_least(1))        # forked workers scoring a group's samples in parallel
    max_failure_fraction: float = checked(0.5, between(0, 1))  # a function that fails (raises, hangs, returns
                                                      # no finite reward) on more than this share of the samples
                                                      # scored so far, or on a whole group, stops the run
    overlong_buffer: int = checked(16, at_least(1))   # nano_miles.rewards.overlong: the last N tokens before
    overlong_penalty: float = checked(1.0, at_least(0))  # max_new_tokens cost up to this much, linearly
    metrics_port: int = checked(9102, PORT_OR_FREE)

    def __post_init__(self):
        super().__post_init__()
        if self.weights and len(self.weights) != len(self.fns):
            raise ConfigError(f"reward.weights has {len(self.weights)} numbers for {len(self.fns)} reward.fns: "
                              "give one weight per function, or none")


@dataclass
class TrainerConfig(Section):
    num_steps: int = checked(240, at_least(1))
    batch_groups: int = checked(16, at_least(1))      # groups (prompts) per optimizer step
    lr: float = checked(1e-4, at_least(0))            # the peak learning rate (after warm-up); 0 never moves the weights (a control run)
    lr_warmup_steps: int = checked(0, at_least(0))    # linear warm-up from lr / N to lr over the first N steps
    lr_schedule: str = checked("constant", one_of(*LR_SCHEDULES))  # after warm-up: constant, or cosine to lr_min
    lr_min: float = checked(0.0, at_least(0))         # cosine: the learning rate at the last step
    weight_decay: float = checked(0.0, at_least(0))
    max_grad_norm: float = checked(1.0, above(0))
    eps_clip: float = checked(0.2, OPEN_FRACTION)     # ratio floor 1 - eps_clip
    eps_clip_high: float = checked(0.28, above(0))    # ratio ceiling 1 + eps_clip_high
    dual_clip_c: float = checked(3.0, above(1))       # for A < 0 the per-token loss is capped at -c * A
    recompute_old_logprobs: bool = checked(False, BOOL)  # pi_old from the trainer (+ truncated IS to the engine's)
    tis_clip: float = checked(2.0, above(0))          # truncation of the importance weight pi_old / pi_engine
    advantage: str = checked("grpo", one_of(*ADVANTAGES))  # the estimator (nano_miles/algo/advantages.py)
    scale_rewards: str = checked("group", one_of(*REWARD_SCALES))  # grpo: divide by the group's std, the
                                                      # step's, or nothing (none: Dr. GRPO)
    loss: str = checked("dapo", one_of(*LOSSES))      # the policy loss (nano_miles/algo/loss.py)
    num_iterations: int = checked(1, at_least(1))     # passes over a step's samples (pi_old fixed before the first)
    mini_batches: int = checked(1, at_least(1))       # optimizer steps per pass, each on its share of the samples
    mask_truncated: bool = checked(False, BOOL)       # a response cut at max_new_tokens trains no token (DAPO)
    entropy_coef: float = checked(0.0, at_least(0))   # entropy bonus in the loss
    kl_coef: float = checked(0.0, at_least(0))        # > 0: KL penalty to the starting policy (kept in bf16)
    kl_estimator: str = checked("k3", one_of(*KL_ESTIMATORS))  # per-token estimate of KL(pi || pi_ref)
    kl_in: str = checked("loss", one_of("loss", "reward"))  # the penalty in the loss, or off each sample's reward
    skip_zero_variance: bool = checked(False, BOOL)   # consume groups whose rewards are all equal without
                                                      # training them; the step waits for batch_groups with signal
    micro_batch_tokens: int = checked(0, at_least(0))  # forward/backward in micro-batches of at most this many
                                                      # (padded) tokens, one optimizer step; 0 = the whole batch
    dtype: str = checked("float32", one_of(*TRAIN_DTYPES))  # bfloat16: autocast, fp32 weights and optimizer
    gradient_checkpointing: bool = checked(False, BOOL)  # recompute activations in the backward pass
    memory_plan: bool = checked(False, BOOL)          # CUDA: the two above from stages/trainer/memory_plan.py
    compile: bool = checked(False, BOOL)              # CUDA: each decoder layer through torch.compile
    endpoint: str = checked("tcp://127.0.0.1:5703", ENDPOINT)  # PULL, bound by the trainer
    device: str = checked("cpu", DEVICE)
    num_threads: int = checked(1, at_least(1))
    eval_every: int = checked(20, at_least(0))        # held-out greedy evaluation every N steps (0 = only at the end)
    eval_samples: int = checked(1, at_least(1))       # > 1: also pass@k with k samples at the rollout temperature
    checkpoint_every: int = checked(20, at_least(0))  # 0 = only at the end
    resume_from: str = checked("", ANY_TEXT)          # a checkpoint (or run directory) to continue from when
                                                      # the run directory has none of its own; "" = fresh start
    control_timeout_s: float = checked(5.0, above(0))  # Lazy Pirate: per-try timeout on the control channel
    control_retries: int = checked(6, at_least(1))
    metrics_port: int = checked(9103, PORT_OR_FREE)

    def __post_init__(self):
        super().__post_init__()
        if self.lr_min and self.lr_schedule != "cosine":
            raise ConfigError(f"trainer.lr_min is where trainer.lr_schedule=cosine ends; the {self.lr_schedule} "
                              "schedule has none: set the cosine schedule, or leave lr_min 0")
        if self.lr_min > self.lr:
            raise ConfigError(f"trainer.lr_min ({self.lr_min:g}) is above trainer.lr ({self.lr:g}): the cosine "
                              "schedule decays from lr down to lr_min")
        if self.scale_rewards != "group" and self.advantage != "grpo":
            raise ConfigError(f"trainer.scale_rewards={self.scale_rewards} is the grpo estimator's option; "
                              f"trainer.advantage={self.advantage} scales its own way: leave it at group")
        if not self.kl_coef and (self.kl_in != "loss" or self.kl_estimator != "k3"):
            raise ConfigError("trainer.kl_in and trainer.kl_estimator shape the KL penalty, which is off at "
                              "trainer.kl_coef = 0: set kl_coef > 0, or leave them")


@dataclass
class MetricsConfig(Section):
    tensorboard: bool = checked(False, BOOL)          # step scalars as TensorBoard events in <run dir>/tensorboard
    wandb_project: str = checked("", ANY_TEXT)        # step scalars to Weights & Biases under this project; "" = off
    plots: bool = checked(True, BOOL)                 # PNG plots into the run dir at the end
    queue_sample_s: float = checked(1.0, at_least(0))  # queue depths into queues.jsonl this often; 0 = never
    save_rollouts: bool = checked(False, BOOL)        # every trained group (ids, rewards) into rollouts.jsonl
    samples_per_step: int = checked(4, at_least(0))   # whole samples (text, reward parts) per step into samples.jsonl


@dataclass
class SecurityConfig(Section):
    curve_dir: str = checked("", ANY_TEXT)  # ZeroMQ CURVE keys from `python -m nano_miles.run.keys DIR`; "" = plain


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
