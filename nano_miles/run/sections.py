"""The config's sections: one dataclass per TOML section, each field with its default and what it accepts.

Library module of `config.py`, which layers files and overrides into a `Config` of these sections and
checks the rules between them; the rules within one section live in its `__post_init__`.
"""

from __future__ import annotations

from dataclasses import dataclass

from nano_miles.run.rules import (ANY_TEXT, BOOL, DEVICE, DROPOUT, ENDPOINT, FRACTION, FUNCTION, FUNCTIONS, HOST, MODULE,
                                  NAMES, NON_EMPTY, NUMBERS, OPEN_FRACTION, PORT, PORT_OR_FREE, SHELL_WORDS, TOP_K,
                                  URL_OR_EMPTY, URLS, Section, above, at_least, between, checked, one_of)
from nano_miles.run.values import ConfigError
from nano_miles.wire.control import PAUSE_MODES

DTYPES = ("float32", "bfloat16", "float16")  # what SGLang and torch both name so
LOCAL_ENGINE_DTYPES = ("float32", "bfloat16")  # python -m nano_miles.local_engine --dtype
STRATEGIES = ("single", "fsdp2")  # one process holding the whole model, or FSDP2 over trainer.world_size ranks
TRAIN_DTYPES = ("float32", "bfloat16")  # the trainer's compute dtype; weights stay fp32 either way
LR_SCHEDULES = ("constant", "cosine")
# the names nano_miles/algo picks its functions by (tests/test_config.py holds them equal; the config
# needs no torch, so it keeps its own copy)
ADVANTAGES = ("grpo", "rloo", "reinforce_pp")
REWARD_SCALES = ("group", "batch", "none")
LOSSES = ("dapo", "grpo", "dr_grpo", "gspo", "gspo_token", "cispo")
KL_ESTIMATORS = ("k1", "k2", "k3")
# every attention and MLP projection of a Qwen2 / Llama-style decoder layer (TRL's, verl's and PEFT's usual set)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
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
    device: str = checked("cpu", DEVICE)  # the local engine's (cpu or cuda); the GPU is the layout's (colocate)
    dtype: str = checked("float32", one_of(*DTYPES))
    num_threads: int = checked(1, at_least(1))        # torch threads of the local engine
    mem_fraction_static: float = checked(0.5, FRACTION)  # sglang: share of the whole GPU for weights + KV
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
    colocate: bool = checked(True, BOOL)              # GPU engines share the trainer's GPUs (their memory split
                                                      # by mem_fraction_static); false: a GPU each, after the trainer's
    urls: list = checked([], URLS)   # engines started elsewhere: ["http://h1:30000", ...]; [] = the replicas
    router_url: str = checked("", URL_OR_EMPTY)       # sglang-router in front of `urls`: generation goes through it

    def __post_init__(self):
        super().__post_init__()
        if self.replicas > 1 and (self.urls or self.router_url):
            raise ConfigError("engine.replicas starts engines here, engine.urls names engines started elsewhere: "
                              "set one of them")
        if self.kind == "local" and self.dtype not in LOCAL_ENGINE_DTYPES:
            self.refuse("dtype", f"{' or '.join(LOCAL_ENGINE_DTYPES)} with engine.kind=local", self.dtype)
        if self.kind == "local" and self.device not in ("cpu", "cuda"):  # Config.engine_gpu picks the GPU
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
    compile: bool = checked(False, BOOL)              # CUDA: decoder layers, log-prob chunks: torch.compile
    lora_rank: int = checked(0, at_least(0))          # > 0: train LoRA adapters of this rank on frozen base
                                                      # weights (PEFT); 0 = full fine-tuning
    lora_alpha: float = checked(32.0, above(0))       # the adapters' scale is lora_alpha / lora_rank
    lora_dropout: float = checked(0.0, DROPOUT)  # dropout on the adapters' input
    lora_target_modules: list = checked(list(LORA_TARGETS), NAMES)  # the linear layers that get adapters
    strategy: str = checked("single", one_of(*STRATEGIES))  # fsdp2: the model sharded over world_size
                                                      # ranks under torch's elastic launcher (docs/scale-out.md)
    world_size: int = checked(1, at_least(1))         # the trainer's processes, one per GPU (fsdp2)
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
        if self.world_size > 1 and self.strategy != "fsdp2":
            raise ConfigError(f"trainer.world_size = {self.world_size} shards the model over that many processes: "
                              "set trainer.strategy = \"fsdp2\" too")
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
