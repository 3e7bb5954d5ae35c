"""One trainer step over a rollout batch, at any model size: advantages, then the policy updates.

Library module used by the trainer (`step_loop.py`); `tests/test_learner.py` pins its contracts.

A step, in order (`Learner.step`):
1. The samples that may train: with `trainer.mask_truncated` a response cut at max_new_tokens trains
   no token (DAPO's overlong filtering), and one whose engine log-probs no loss can use
   (`loss.unusable_logprobs`) is left out by name; both still count in their group's advantages.
2. pi_old, once, before any update: the engine's log-probs, or the trainer's own
   (`trainer.recompute_old_logprobs`, with truncated importance weights towards the engine's), and the
   reference's with a KL penalty; micro-batch by micro-batch (`trainer.micro_batch_tokens`).
3. Advantages from the step's rewards, group by group (`nano_miles/algo/advantages.py`,
   `trainer.advantage`); with `trainer.kl_in = "reward"` each sample's reward first loses
   kl_coef x its summed KL to the reference.
4. `trainer.num_iterations` passes over the samples, each in `trainer.mini_batches` optimizer steps on
   consecutive shares of them. An optimizer step's loss (`nano_miles/algo/loss.py`, `trainer.loss`)
   is divided by that optimizer step's totals (tokens, samples), micro-batch by micro-batch, so the
   micro-batches' gradients add up to the whole share's. A step whose gradient norm is not finite is
   skipped: counted, never applied. At 1 pass and 1 mini-batch this is one optimizer step on the
   whole batch, the update this trainer always took.
5. One learning-rate scheduler step: the schedule counts trainer steps (rollout batches), so do the
   weight version and the staleness rules, however many optimizer steps a batch takes.

Precision: weights and optimizer state stay fp32; `trainer.dtype = "bfloat16"` runs the forward and
backward passes under autocast, and log-softmax is always fp32 (`grpo.token_scores`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import resource
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nano_miles.algo import advantages as estimators
from nano_miles.algo.diagnostics import LearnResult, LossDiagnostics
from nano_miles.algo.grpo import TokenBatch, assemble_batch, micro_batches, token_scores
from nano_miles.algo.loss import LossConfig, StepTotals, kl_terms, policy_loss, truncated_is_weights, unusable_logprobs
from nano_miles.stages.trainer import packed_attention, sharded
from nano_miles.weights.named_tensors import has_adapters

TRUNCATED = "truncated"  # why a sample trains no token: cut at max_new_tokens, with trainer.mask_truncated


def lr_factor(step: int, warmup_steps: int, schedule: str, num_steps: int, min_ratio: float) -> float:
    """The learning rate of trainer step `step` (0-based) as a fraction of the peak: (step + 1) /
    warmup_steps during warm-up, then 1 (constant) or a cosine from 1 down to `min_ratio` at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, num_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class TrainSample:
    """One sample as the learner trains it (from a `wire.data.Sample`, its group's prompt and its reward)."""

    prompt: object      # token ids, as the engine saw them
    response: object    # token ids, as the engine produced them
    logprobs: object    # the engine's log-probs of the response tokens
    reward: float
    group: int          # which of the step's groups it belongs to: advantages are taken per group
    finish_reason: str = "stop"  # "length": cut at max_new_tokens
    loss_mask: object = None     # bool (R,): the model's tokens, the ones that train; None: every token


@dataclass
class Part:
    """A micro-batch as every pass trains it, with what was fixed before the first update."""

    rows: list[int]                  # its samples, as indices into the step's
    batch: TokenBatch
    old_logp: torch.Tensor           # pi_old: the engine's log-probs, or the trainer's recomputed ones
    is_weights: torch.Tensor | None  # truncated pi_old / pi_engine (recomputed pi_old only)
    ref_logp: torch.Tensor | None    # the reference policy's (a KL penalty only)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def shares(rows: list[int], num: int) -> list[list[int]]:
    """`rows` in `num` consecutive shares as equal as they can be (the first ones one longer); none empty."""
    size, extra = divmod(len(rows), num)
    out, start = [], 0
    for k in range(num):
        end = start + size + (k < extra)
        out.append(rows[start:end])
        start = end
    return [s for s in out if s]


def compile_layers(model) -> int:
    """Run each decoder layer (the classes transformers keeps whole: `_no_split_modules`) through
    torch.compile, shapes dynamic (every micro-batch packs another length); parameter names stay as
    they are, so checkpoints and weight pushes see the same model. How many layers it compiled."""
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def make_learner(cfg, model, tokenizer) -> "Learner":
    """The run's learner for `model`: `cfg` is the whole config (its trainer and rollout sections)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Learner(cfg.trainer, model, pad_id, cfg.rollout.temperature, cfg.rollout.max_new_tokens)


class Learner:
    def __init__(self, trainer_cfg, model, pad_id: int, temperature: float, max_new_tokens: int = 0):
        t = self.cfg = trainer_cfg
        self.model, self.pad_id, self.temperature = model, pad_id, temperature
        self.device = next(model.parameters()).device
        on_gpu = self.device.type == "cuda"
        if t.gradient_checkpointing and hasattr(model, "activation_checkpointing_enable"):  # the newer name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif t.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # a micro-batch's samples end to end, no padding (variable-length FlashAttention); the CPU keeps
        # the padded batch, whose numbers the tests pin
        if on_gpu:
            packed_attention.enable(model)
        # the starting policy, before any checkpoint is loaded into `model`: the KL anchor of the run
        # (a LoRA model's is itself with its adapters switched off: no second copy)
        self.reference = None
        if t.kl_coef > 0 and not has_adapters(model):
            self.reference = copy.deepcopy(model).to(torch.bfloat16).eval().requires_grad_(False)
        # trainer.strategy = fsdp2: this rank keeps its rows of every parameter (and of the reference's),
        # trains its share of each optimizer step's micro-batches, and FSDP averages the gradients
        self.rank, self.world = sharded.rank_and_world() if t.strategy == "fsdp2" else (0, 1)
        if t.strategy == "fsdp2":
            sharded.shard(model)
            if self.reference is not None:
                sharded.shard(self.reference)
        if t.compile and on_gpu:  # after the reference's copy: a compiled layer's call is bound to its module
            compile_layers(model)
        self.fused_scores = t.compile and on_gpu  # the log-probs' passes over the vocabulary, compiled too
        # after sharding, which replaces the parameters; fused: one kernel for the whole update on a GPU,
        # the CPU keeps the default (its numbers unchanged)
        self.trained = [p for p in model.parameters() if p.requires_grad]  # all, or a LoRA model's adapters
        self.optimizer = torch.optim.AdamW(self.trained, lr=t.lr, weight_decay=t.weight_decay,
                                           **({"fused": True} if on_gpu else {}))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, t.lr_warmup_steps, t.lr_schedule, t.num_steps,
                                                   t.lr_min / t.lr if t.lr > 0 else 0.0))
        self.kl_in_loss = t.kl_coef if t.kl_in == "loss" else 0.0
        self.loss_cfg = LossConfig(name=t.loss, eps_clip=t.eps_clip, eps_clip_high=t.eps_clip_high,
                                   dual_clip_c=t.dual_clip_c, max_new_tokens=max_new_tokens,
                                   kl_coef=self.kl_in_loss, kl_estimator=t.kl_estimator,
                                   entropy_coef=t.entropy_coef)

    def autocast(self):
        if self.cfg.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    # ------------------------------------------------------------------ state in checkpoints
    def state_dict(self) -> dict:
        """What the trainer state file keeps; a sharded optimizer's state is saved by every rank
        (`sharded.save_weights`), not here."""
        if self.cfg.strategy == "fsdp2":
            return {"lr_schedule": self.scheduler.state_dict()}
        return {"optimizer": self.optimizer.state_dict(), "lr_schedule": self.scheduler.state_dict()}

    def load_state_dict(self, saved: dict, directory=None) -> None:
        """`saved`: a trainer state file's; `directory`: its checkpoint, where a sharded optimizer's state is."""
        if "optimizer" in saved and self.cfg.strategy != "fsdp2":
            self.optimizer.load_state_dict(saved["optimizer"])
        else:
            sharded.load_optimizer(self.model, self.optimizer, Path(directory), saved)
        self.scheduler.load_state_dict(saved["lr_schedule"])

    # ------------------------------------------------------------------ the step
    def step(self, samples: list[TrainSample]) -> tuple[LearnResult, np.ndarray]:
        """Train on a rollout batch: (what the step did, each sample's advantage as float32). Sharded,
        every rank is given the whole batch and plans it alike; each trains its share of every
        optimizer step's micro-batches, and the result is the whole step's on every rank."""
        started = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        rows, dropped = self.trainable(samples)
        lengths = [len(s.prompt) + len(s.response) - 1 for s in samples]
        self.model.train()
        plan = [[self.assemble_part(samples, [share[i] for i in idx])
                 for idx in micro_batches([lengths[r] for r in share], self.cfg.micro_batch_tokens)]
                for share in shares(rows, self.cfg.mini_batches)]
        for share in plan:
            self.prepare(share)
        parts = [part for share in plan for part in share]
        advantages = self.advantages(samples, parts)
        for part in parts:
            adv = torch.from_numpy(advantages[part.rows]).to(self.device)[:, None]
            part.batch.advantages = torch.where(part.batch.loss_mask, adv, torch.zeros_like(part.batch.old_logprobs))
        losses, norms, measured, first_pass, kl_old = [], [], [], [], []
        num_skipped = 0
        for iteration in range(self.cfg.num_iterations):
            for share in plan:
                loss, norm = self.update(share, measured, first_pass if iteration == 0 else None)
                losses.append(loss)
                if math.isfinite(norm):
                    norms.append(norm)
                else:
                    num_skipped += 1
            if self.cfg.num_iterations > 1:
                kl_old.append(self.kl_to_old(plan))
        lr = self.optimizer.param_groups[0]["lr"]
        with warnings.catch_warnings():  # every optimizer step of this one may have been skipped: still a step
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            self.scheduler.step()
        # each rank measured its own micro-batches: the step's figures are over all of them
        losses = sharded.all_sum(torch.tensor(losses, dtype=torch.float64)).tolist()
        measured, first_pass = sharded.all_items(measured), sharded.all_items(first_pass)
        weights = sharded.all_items([p.is_weights[p.batch.loss_mask].cpu() for p in parts if p.is_weights is not None])
        elapsed = time.perf_counter() - started
        means = LossDiagnostics.token_mean(measured)
        means.parity = LossDiagnostics.token_mean(first_pass).parity  # before any update: the engine's gap
        result = LearnResult(
            pg_loss=float(np.mean(losses)) if losses else 0.0, means=means,
            num_tokens=sum(p.batch.num_tokens for p in parts), grad_norm=max(norms, default=0.0), lr=lr,
            num_micro_batches=len(parts), num_optimizer_steps=len(losses) - num_skipped,
            num_skipped_steps=num_skipped, dropped_samples=dropped, kl_old=kl_old,
            peak_memory_mb=peak_memory_mb(self.device),
            train_tokens_per_s=self.cfg.num_iterations * sum(p.batch.packing.num_tokens for p in parts) / elapsed)
        if weights:
            w = torch.cat(weights)
            result.is_weight_mean, result.is_weight_max = float(w.mean()), float(w.max())
            result.is_weight_clipped = float((w >= self.cfg.tis_clip - 1e-6).float().mean())
        return result, advantages

    def trainable(self, samples: list[TrainSample]) -> tuple[list[int], dict[str, int]]:
        """The samples whose tokens train, and how many were left out, by reason."""
        rows, dropped = [], {}
        for i, s in enumerate(samples):
            reason = TRUNCATED if self.cfg.mask_truncated and s.finish_reason == "length" \
                else unusable_logprobs(s.logprobs)
            if reason is None:
                rows.append(i)
            else:
                dropped[reason] = dropped.get(reason, 0) + 1
        return rows, dropped

    def mine(self, share: list[Part]) -> list[Part | None]:
        """This rank's micro-batches of an optimizer step's share, then None for each pass it makes
        without one: FSDP gathers and reduces on every pass, so every rank makes as many."""
        own = share[self.rank::self.world]
        return own + [None] * (-(-len(share) // self.world) - len(own))

    def assemble_part(self, samples: list[TrainSample], rows: list[int]) -> Part:
        """A micro-batch's tokens; pi_old the engine's until `prepare`."""
        chosen = [samples[i] for i in rows]
        batch = self.assemble(chosen, [0.0] * len(chosen))
        return Part(rows, batch, batch.old_logprobs, None, None)

    def prepare(self, share: list[Part]) -> None:
        """pi_old and the reference's log-probs of this rank's micro-batches, before any update."""
        if not (self.cfg.recompute_old_logprobs or self.cfg.kl_coef > 0):
            return
        with torch.no_grad(), self.autocast():
            for part in self.mine(share):
                p = part or share[0]  # a pass without a micro-batch of its own: its result is not kept
                old_logp, weights, ref_logp = p.batch.old_logprobs, None, None
                if self.cfg.recompute_old_logprobs:
                    old_logp = self.logprobs(self.model, p.batch)
                    weights = truncated_is_weights(old_logp, p.batch.old_logprobs, p.batch.loss_mask,
                                                   self.cfg.tis_clip)
                if self.cfg.kl_coef > 0:
                    ref_logp = self.reference_logprobs(p.batch)
                if part is not None:
                    part.old_logp, part.is_weights, part.ref_logp = old_logp, weights, ref_logp

    def advantages(self, samples: list[TrainSample], parts: list[Part]) -> np.ndarray:
        """Each sample's advantage, from its group's rewards (less the KL penalty with kl_in = reward)."""
        rewards = np.array([s.reward for s in samples], np.float64)  # float32 values (the wire's), exactly
        if self.cfg.kl_coef > 0 and self.cfg.kl_in == "reward":
            kl = torch.zeros(len(samples), dtype=torch.float64)
            for p in parts:  # KL of the behaviour policy to the reference, summed over each response
                if p.ref_logp is not None:  # measured by this rank
                    kl[p.rows] = kl_terms(p.old_logp, p.ref_logp, p.batch.loss_mask,
                                          self.cfg.kl_estimator).sum(dim=1).double().cpu()
            rewards -= self.cfg.kl_coef * sharded.all_sum(kl).numpy()
        groups = sorted({s.group for s in samples})
        members = [[i for i, s in enumerate(samples) if s.group == g] for g in groups]
        out = np.zeros(len(samples), np.float32)
        for idx, adv in zip(members, estimators.estimate(self.cfg.advantage, [rewards[m] for m in members],
                                                         self.cfg.scale_rewards)):
            out[idx] = adv.numpy()
        return out

    def update(self, share: list[Part], measured: list, first_pass: list | None) -> tuple[float, float]:
        """One optimizer step on a share of the samples: (this rank's part of its loss, its gradient
        norm before clipping; not finite: the step was skipped)."""
        totals = StepTotals(num_tokens=sum(p.batch.num_tokens for p in share),
                            num_samples=sum(p.batch.num_samples for p in share))
        self.optimizer.zero_grad(set_to_none=True)
        outputs = []
        for p in self.mine(share):  # nothing here waits for the device: its measurements are read after the step
            if p is None:  # a pass that trains nothing: FSDP's gathers and reductions, gradients 0
                with self.autocast():
                    (self.logprobs(self.model, share[0].batch).sum() * 0.0).backward()
                continue
            b = p.batch
            with self.autocast():
                logp, entropy = token_scores(self.model, b.input_ids, b.targets, b.attention_mask, self.temperature,
                                             positions=b.loss_mask, with_entropy=True,
                                             entropy_grad=self.cfg.entropy_coef > 0, packing=b.packing,
                                             index=b.loss_index, fused=self.fused_scores)
                out = policy_loss(logp, p.old_logp, b.advantages, b.loss_mask, self.loss_cfg, totals,
                                  engine_logp=b.old_logprobs, is_weights=p.is_weights, ref_logp=p.ref_logp,
                                  entropy=entropy)
            # divided by the share's totals: the micro-batches' gradients add up; FSDP averages over
            # the ranks, so each rank's sum counts world times
            (out.loss * self.world if self.world > 1 else out.loss).backward()
            outputs.append(out)
        norm = float(torch.nn.utils.clip_grad_norm_(self.trained, self.cfg.max_grad_norm))
        if math.isfinite(norm):
            self.optimizer.step()
        else:  # a NaN or inf gradient never reaches the weights (nor, so, an engine)
            self.optimizer.zero_grad(set_to_none=True)
        losses = torch.stack([out.loss.detach() for out in outputs]).tolist() if outputs else []
        for out in outputs:
            measured.append((out.means, out.num_tokens))
            if first_pass is not None:
                first_pass.append((out.means, out.num_tokens))
        loss = sum(losses)
        return loss, norm

    def kl_to_old(self, plan: list[list[Part]]) -> float:
        """KL(pi_old || pi) per response token after a pass (k3 on the samples pi_old drew)."""
        total, count = 0.0, 0
        with torch.no_grad(), self.autocast():
            for share in plan:
                for part in self.mine(share):
                    p = part or share[0]
                    logp = self.logprobs(self.model, p.batch)
                    if part is not None:
                        total += float(kl_terms(p.old_logp, logp, p.batch.loss_mask, "k3").sum())
                        count += p.batch.num_tokens
        total, count = sharded.all_sum(torch.tensor([total, count], dtype=torch.float64)).tolist()
        return total / max(1, count)

    def assemble(self, samples: list[TrainSample], advantages) -> TokenBatch:
        return assemble_batch([s.prompt for s in samples], [s.response for s in samples],
                              [s.logprobs for s in samples], list(advantages), self.pad_id,
                              [s.loss_mask for s in samples]).to(self.device)

    def reference_logprobs(self, batch) -> torch.Tensor:
        if self.reference is not None:
            return self.logprobs(self.reference, batch)
        with self.model.disable_adapter():  # LoRA: the base model is the reference
            return self.logprobs(self.model, batch)

    def logprobs(self, model, batch) -> torch.Tensor:
        return token_scores(model, batch.input_ids, batch.targets, batch.attention_mask, self.temperature,
                            positions=batch.loss_mask, packing=batch.packing, index=batch.loss_index,
                            fused=self.fused_scores)[0]
