"""One GRPO optimizer step over a step's samples, at any model size: the trainer's arithmetic.

Library module used by the trainer (`step_loop.py`); `tests/test_learner.py` pins its contracts.

A step's samples are packed into micro-batches of at most `trainer.micro_batch_tokens` padded tokens
(`grpo.micro_batches`); each micro-batch's loss is divided by the step's response-token count, its
gradient accumulates, and the optimizer steps once: the same update as the whole batch at once. The
behaviour log-probs (with `trainer.recompute_old_logprobs`) and the reference log-probs (with
`trainer.kl_coef` > 0) are computed micro-batch by micro-batch too.

Precision: weights and optimizer state stay fp32; `trainer.dtype = "bfloat16"` runs the forward and
backward passes under autocast (the usual mixed precision), and log-softmax is always fp32
(`grpo.token_scores`). The learning rate follows `lr_factor` (linear warm-up, then constant or cosine),
one scheduler step per optimizer step; its state goes into every checkpoint with the optimizer's.
"""

from __future__ import annotations

import contextlib
import copy
import math
import resource
import time
from dataclasses import dataclass

import torch

from nano_miles.algo.diagnostics import LearnResult, LossDiagnostics
from nano_miles.algo.grpo import assemble_batch, micro_batches, token_scores
from nano_miles.algo.loss import LossConfig, ppo_loss, truncated_is_weights


def lr_factor(step: int, warmup_steps: int, schedule: str, num_steps: int, min_ratio: float) -> float:
    """The learning rate of optimizer step `step` (0-based) as a fraction of the peak: (step + 1) /
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
    """One sample as the learner trains it (from a `wire.data.Sample` and its group's prompt and advantage)."""

    prompt: object      # token ids, as the engine saw them
    response: object    # token ids, as the engine produced them
    logprobs: object    # the engine's log-probs of the response tokens
    advantage: float


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class Learner:
    def __init__(self, trainer_cfg, model, pad_id: int, temperature: float):
        t = self.cfg = trainer_cfg
        self.model, self.pad_id, self.temperature = model, pad_id, temperature
        self.device = next(model.parameters()).device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, t.lr_warmup_steps, t.lr_schedule, t.num_steps,
                                                   t.lr_min / t.lr if t.lr > 0 else 0.0))
        self.loss_cfg = LossConfig(t.eps_clip, t.eps_clip_high, t.dual_clip_c)
        if t.gradient_checkpointing and hasattr(model, "activation_checkpointing_enable"):  # the newer name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif t.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # the starting policy, before any checkpoint is loaded into `model`: the KL anchor of the run
        self.reference = None
        if t.kl_coef > 0:
            self.reference = copy.deepcopy(model).to(torch.bfloat16).eval().requires_grad_(False)

    def autocast(self):
        if self.cfg.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    # ------------------------------------------------------------------ state in checkpoints
    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "lr_schedule": self.scheduler.state_dict()}

    def load_state_dict(self, saved: dict) -> None:
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["lr_schedule"])

    # ------------------------------------------------------------------ the step
    def step(self, samples: list[TrainSample]) -> LearnResult:
        started = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        lengths = [len(s.prompt) + len(s.response) - 1 for s in samples]
        parts = [self.assemble([samples[i] for i in idx])
                 for idx in micro_batches(lengths, self.cfg.micro_batch_tokens)]
        num_step_tokens = sum(b.num_tokens for b in parts)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss, measured, is_weights = 0.0, [], []
        for batch in parts:
            old_logp, weights, ref_logp = batch.old_logprobs, None, None
            with torch.no_grad(), self.autocast():
                if self.cfg.recompute_old_logprobs:
                    old_logp = self.logprobs(self.model, batch)
                    weights = truncated_is_weights(old_logp, batch.old_logprobs, batch.loss_mask, self.cfg.tis_clip)
                    is_weights.append(weights[batch.loss_mask])
                if self.reference is not None:
                    ref_logp = self.logprobs(self.reference, batch)
            with self.autocast():
                logp, entropy = token_scores(self.model, batch.input_ids, batch.targets, batch.attention_mask,
                                             self.temperature, positions=batch.loss_mask, with_entropy=True)
                out = ppo_loss(logp, old_logp, batch.advantages, batch.loss_mask, self.loss_cfg,
                               engine_logp=batch.old_logprobs, is_weights=weights, ref_logp=ref_logp,
                               kl_coef=self.cfg.kl_coef, num_step_tokens=num_step_tokens, entropy=entropy)
            out.loss.backward()  # divided by the step's token count: the micro-batches' gradients add up
            loss += float(out.loss.detach())
            measured.append((out.means, out.num_tokens))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        elapsed = time.perf_counter() - started
        result = LearnResult(
            pg_loss=loss, means=LossDiagnostics.token_mean(measured), num_tokens=num_step_tokens,
            grad_norm=float(grad_norm), lr=lr, num_micro_batches=len(parts), peak_memory_mb=peak_memory_mb(self.device),
            train_tokens_per_s=sum(int(b.attention_mask.sum()) for b in parts) / elapsed)
        if is_weights:
            w = torch.cat(is_weights)
            result.is_weight_mean, result.is_weight_max = float(w.mean()), float(w.max())
            result.is_weight_clipped = float((w >= self.cfg.tis_clip - 1e-6).float().mean())
        return result

    def assemble(self, samples: list[TrainSample]):
        return assemble_batch([s.prompt for s in samples], [s.response for s in samples],
                              [s.logprobs for s in samples], [s.advantage for s in samples],
                              self.pad_id).to(self.device)

    def logprobs(self, model, batch) -> torch.Tensor:
        return token_scores(model, batch.input_ids, batch.targets, batch.attention_mask, self.temperature,
                            positions=batch.loss_mask)[0]
