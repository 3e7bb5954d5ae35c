"""The trainer's memory plan: the micro-batch size and activation checkpointing that fit a GPU beside SGLang.

Run: python -m nano_miles.stages.trainer.memory_plan [--config FILE] [--gpu-gib 140] [--section.key=value ...]
(a dry run: reads the model's config.json, builds nothing, prints the plan). With `trainer.memory_plan =
true` a CUDA trainer applies the plan at start and logs it; without it the config's own
`trainer.micro_batch_tokens` and `trainer.gradient_checkpointing` hold.

The estimate, per GPU byte (bf16 autocast, fp32 master weights):
  state        16 B a parameter: fp32 weights, gradients and AdamW's two moments (+ 2 B for the bf16
               reference with a KL penalty); with LoRA 16 B an adapter parameter and the frozen base's
               own (2 B in bf16)
  copies       2 B a parameter for the flat weight push's buffer (the whole model in the engine's dtype,
               kept between pushes: SGLang beside the trainer, `engine.weight_transport = "tensor"`);
               2 B more for a full fine-tune under bf16 autocast, whose bf16 casts of the fp32 weights
               live from the forward pass to the backward (a LoRA base in bf16 is used as it is)
  fixed        FIXED_GIB: the output head's chunk of fp32 logits and what surrounds it (grpo.py), the
               allocator's slack
  activations  per token of a micro-batch, without checkpointing: every layer keeps ~(38 h + 9 i) bytes
               (h the hidden size, i the MLP's); with it, each layer keeps its fp32 input (4 h) and one
               layer at a time is recomputed; both times ACTIVATION_MARGIN
The activation coefficients were fitted on one H200 at the Qwen2.5-0.5B shape; against the trainer peaks
measured since (bench/results/gpu/README.md, "Real model shapes": full fine-tunes at 0.5B and 1.5B, LoRA
at 1.5B and 7B, with checkpointing and without) the whole estimate errs high by 13 to 30 %; before the
copies were counted it said 40.6 GiB for a 7B LoRA run that peaked at 47.7. Those peaks were measured
with 256 MiB logit chunks; the 1 GiB chunks of a compiled trainer since added 0.99 GiB to the 0.5B
step's peak, which every estimate still covers (the nearest: 3B beside SGLang, 59.1 + 1 against 60.5
GiB). The trainer's share is the GPU less the engine's static fraction (engine.mem_fraction_static,
when SGLang runs on this GPU) less ENGINE_RESERVE_GIB for what SGLang allocates beyond it (CUDA graphs,
prefill activations).

Sharded over N ranks (`trainer.strategy = "fsdp2"`, `trainer.world_size = N`), each GPU keeps 1/N of the
state, and FSDP2 gathers full fp32 units as it goes: the root (embeddings, head, final norm) stays
gathered for the whole step with its gradient, and a decoder layer is gathered with the next one
prefetched and its gradient before the reduce-scatter; activations are one micro-batch's, as in one
process. These sharded terms follow FSDP2's design and are not yet fitted to a measured peak.
Rank 0's GPU, which SGLang shares, is the tightest, and every rank takes its plan.

The choice: no checkpointing (a quarter to a third less compute) at the largest micro-batch of
NO_CHECKPOINT_TOKENS that fits; else checkpointing at the largest of CHECKPOINT_TOKENS; else the model
does not fit, and the error says by how much and, beside SGLang, at which engine share it would.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from nano_miles.run.cli import UserError

GIB = 2**30
FIXED_GIB = 2.0
ACTIVATION_MARGIN = 1.1
ENGINE_RESERVE_GIB = 8.0
ENGINE_MIN_KV_GIB = 1.0
NO_CHECKPOINT_TOKENS = (32768, 16384, 8192)
CHECKPOINT_TOKENS = (32768, 16384, 8192, 4096, 2048)


@dataclass
class Plan:
    micro_batch_tokens: int
    gradient_checkpointing: bool
    peak_gib: float        # the estimate of the trainer's peak with this choice (on each rank's GPU)
    available_gib: float   # the trainer's share of the GPU
    state_gib: float       # weights, gradients, optimizer state (and the reference): a rank's share
    world: int = 1         # the ranks the state is sharded over

    def describe(self) -> str:
        ranks = f" on each of {self.world} ranks" if self.world > 1 else ""
        return (f"micro_batch_tokens={self.micro_batch_tokens}, gradient_checkpointing="
                f"{str(self.gradient_checkpointing).lower()}: about {self.peak_gib:.1f} GiB of the trainer's "
                f"{self.available_gib:.1f} GiB{ranks} ({self.state_gib:.1f} GiB of it weights, gradients and "
                "AdamW state)")


@dataclass
class Shape:
    num_parameters: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    linear_sizes: dict = dataclasses.field(default_factory=dict)  # linear layer name -> sum of in + out
    layer_parameters: int = 0  # one decoder layer's (0: unknown, taken as an equal share of the model)

    def units(self) -> tuple[int, int]:
        """(the root's parameters, one decoder layer's): what FSDP2 gathers in full."""
        layer = self.layer_parameters or self.num_parameters // self.num_layers
        return max(0, self.num_parameters - layer * self.num_layers), layer

    def adapter_parameters(self, rank: int, targets) -> int:
        """How many parameters LoRA adapters of `rank` on the `targets` linear layers have: r (in + out) each."""
        return rank * sum(self.linear_sizes.get(name, 0) for name in targets)

    @classmethod
    def of(cls, model_dir: Path) -> "Shape":
        """The shape of the HF model in `model_dir`, from its config.json alone (built on the meta device)."""
        config = json.loads((model_dir / "config.json").read_text())
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers") if k not in config]
        if missing:
            raise UserError(f"cannot plan memory for {model_dir}: its config.json has no {', '.join(missing)}; "
                            "set trainer.memory_plan = false and choose trainer.micro_batch_tokens and "
                            "trainer.gradient_checkpointing yourself")
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
        sizes: dict[str, int] = {}
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear):
                leaf = name.rsplit(".", 1)[-1]
                sizes[leaf] = sizes.get(leaf, 0) + m.in_features + m.out_features
        kinds = set(getattr(model, "_no_split_modules", None) or ())
        layer = next((m for m in model.modules() if type(m).__name__ in kinds), None)
        return cls(sum(p.numel() for p in model.parameters()), config["hidden_size"], config["intermediate_size"],
                   config["num_hidden_layers"], sizes,
                   sum(p.numel() for p in layer.parameters()) if layer is not None else 0)

    def activation_bytes(self, tokens: int, checkpointing: bool) -> float:
        layer = 38 * self.hidden_size + 9 * self.intermediate_size  # one layer's, per token
        kept = 4 * self.hidden_size * self.num_layers + layer if checkpointing else layer * self.num_layers
        return ACTIVATION_MARGIN * kept * tokens


def footprint(shape: Shape, *, with_reference: bool = False, adapters: int = 0, base_bytes: int = 4,
              world: int = 1, push_bytes: int = 0, is_autocast: bool = False) -> tuple[float, float]:
    """(state, everything but the activations) in bytes on each GPU; the keys as `plan`'s."""
    if adapters:
        state = shape.num_parameters * base_bytes + adapters * 16
    else:
        state = shape.num_parameters * (16 + (2 if with_reference else 0))
    state /= world
    root, layer = shape.units()
    # FSDP2's full fp32 units: the root and its gradient all step, a layer, the next and a layer's gradient
    gathered = 4 * (2 * root + 3 * layer) if world > 1 else 0
    casts = 2 * shape.num_parameters if is_autocast and not adapters and world == 1 else 0
    return state, state + gathered + shape.num_parameters * push_bytes + casts + FIXED_GIB * GIB


def plan(shape: Shape, gpu_bytes: int, engine_fraction: float, *, with_reference: bool = False,
         adapters: int = 0, base_bytes: int = 4, world: int = 1, push_bytes: int = 0,
         is_autocast: bool = False) -> Plan:
    """The micro-batch size and checkpointing for a model of `shape` on a GPU of `gpu_bytes` of which an
    engine holds `engine_fraction` (0: none); UserError if nothing fits. `adapters` > 0: LoRA, that many
    trained parameters on a frozen base of `base_bytes` a parameter (whose reference costs nothing), else
    `with_reference` (a KL penalty's bf16 copy); `world` > 1: the state sharded over that many ranks
    (FSDP2), each GPU planned alike; `push_bytes`: a parameter's share of the weight push's flat buffer;
    `is_autocast`: bf16 compute on fp32 weights."""
    available = gpu_bytes * (1 - engine_fraction) - (ENGINE_RESERVE_GIB * GIB if engine_fraction else 0)
    state, base = footprint(shape, with_reference=with_reference, adapters=adapters, base_bytes=base_bytes,
                            world=world, push_bytes=push_bytes, is_autocast=is_autocast)
    for checkpointing, budgets in ((False, NO_CHECKPOINT_TOKENS), (True, CHECKPOINT_TOKENS)):
        for tokens in budgets:
            peak = base + shape.activation_bytes(tokens, checkpointing)
            if peak <= available:
                return Plan(tokens, checkpointing, peak / GIB, available / GIB, state / GIB, world)
    least = base + shape.activation_bytes(CHECKPOINT_TOKENS[-1], True)
    how = "LoRA" if adapters else "full fine-tuning"
    raise UserError(f"{how} of {shape.num_parameters / 1e9:.2f} B parameters needs about {least / GIB:.0f} GiB "
                    f"on the trainer's GPU ({state / GIB:.0f} GiB of weights, gradients and AdamW state alone); "
                    f"{available / GIB:.0f} GiB is left beside the engine: "
                    f"{engine_share_hint(shape, gpu_bytes, engine_fraction, least)}"
                    "put the engine on another GPU, shard the trainer over more GPUs (trainer.strategy = "
                    "\"fsdp2\", trainer.world_size) " + ("or train a smaller model" if adapters else
                                                         "or train LoRA adapters (trainer.lora_rank)"))


def engine_share_hint(shape: Shape, gpu_bytes: int, engine_fraction: float, least: float) -> str:
    """The refusal's first way out, when SGLang shares the GPU: the largest engine.mem_fraction_static at which
    the trainer's least need fits, if SGLang's share there still holds the model's bf16 weights and
    ENGINE_MIN_KV_GIB of KV cache (below that it could not serve a step's batch)."""
    if not engine_fraction:
        return ""
    share = int(100 * (1 - (least + ENGINE_RESERVE_GIB * GIB) / gpu_bytes)) / 100  # rounded down
    kv = share * gpu_bytes - 2 * shape.num_parameters
    if kv < ENGINE_MIN_KV_GIB * GIB:
        return "a smaller engine.mem_fraction_static cannot make room (SGLang's share must hold its weights); "
    return (f"at engine.mem_fraction_static = {share:.2f} or lower the trainer fits (SGLang's share at {share:.2f} "
            f"holds {2 * shape.num_parameters / GIB:.1f} GiB of bf16 weights and {kv / GIB:.1f} GiB of KV cache), "
            "or ")


def engine_fraction(cfg) -> float:
    """The share of the trainer's GPU that an engine holds: SGLang started by this run on the trainer's GPU
    (engine.colocate; otherwise each engine has a GPU of its own)."""
    e = cfg.engine
    return e.mem_fraction_static if e.kind == "sglang" and not e.urls and e.colocate else 0.0


def plan_for(cfg, gpu_bytes: int, shape: Shape | None = None) -> Plan:
    """The plan for `cfg`'s model (`shape`, when the caller has read it already) and trainer settings."""
    import torch
    t, e, shape = cfg.trainer, cfg.engine, shape or Shape.of(cfg.model_dir)
    is_sharded = t.strategy == "fsdp2"
    # the flat buffer: SGLang started by this run, weights pushed from one unsharded model (tensor_sender.py)
    is_flat = e.kind == "sglang" and not e.urls and e.weight_transport == "tensor" and not is_sharded
    return plan(shape, gpu_bytes, engine_fraction(cfg), with_reference=t.kl_coef > 0,
                adapters=shape.adapter_parameters(t.lora_rank, t.lora_target_modules),
                base_bytes=2 if t.dtype == "bfloat16" else 4, world=t.world_size if is_sharded else 1,
                push_bytes=getattr(torch, e.dtype).itemsize if is_flat else 0, is_autocast=t.dtype == "bfloat16")


def apply(cfg, chosen: Plan):
    """`cfg` with the plan's micro-batch size and checkpointing in the trainer section."""
    trainer = dataclasses.replace(cfg.trainer, micro_batch_tokens=chosen.micro_batch_tokens,
                                  gradient_checkpointing=chosen.gradient_checkpointing)
    return dataclasses.replace(cfg, trainer=trainer)


def fit_to_device(cfg) -> tuple:
    """(`cfg` as the trainer runs it, the plan or None): on a GPU with `trainer.memory_plan`, the micro-batch
    size and checkpointing that fit beside SGLang. A CUDA device torch does not see is a UserError."""
    import torch

    from nano_miles.run.cli import UserError
    device = torch.device(cfg.trainer.device)
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"trainer.device is {cfg.trainer.device!r}, but torch {torch.__version__} sees "
                        f"{torch.cuda.device_count()} CUDA devices here")
    if not (cfg.trainer.memory_plan and device.type == "cuda"):
        return cfg, None
    chosen = plan_for(cfg, torch.cuda.get_device_properties(device).total_memory)
    return apply(cfg, chosen), chosen


def main(argv: list[str]) -> int:
    from nano_miles.run.cli import ArgumentParser
    from nano_miles.run.config import parse_config
    parser = ArgumentParser(prog="python -m nano_miles.stages.trainer.memory_plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-gib", type=float, default=None,
                        help="the GPU's memory in GiB (default: the first CUDA device's; an H200 has 140)")
    cfg, args = parse_config(argv, parser)
    if args.gpu_gib is None:
        import torch
        if not torch.cuda.is_available():
            raise UserError("no CUDA device here: give the GPU's memory with --gpu-gib")
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    else:
        gpu_bytes = int(args.gpu_gib * GIB)
    shape = Shape.of(cfg.model_dir)
    print(f"{cfg.model_dir}: {shape.num_parameters / 1e9:.2f} B parameters; GPU {gpu_bytes / GIB:.0f} GiB, "
          f"engine's static share {engine_fraction(cfg):.2f}")
    print(plan_for(cfg, gpu_bytes, shape).describe())
    return 0


if __name__ == "__main__":
    from nano_miles.run.cli import run
    run(main, "memory_plan")
