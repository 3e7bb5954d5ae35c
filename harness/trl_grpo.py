"""Trains a nano-miles config's policy, task and reward with Hugging Face TRL's GRPOTrainer instead.
Run: python -m harness.trl_grpo --out FILE [--config FILE] [--section.key=value ...] [--generation generate|paged]
(bench/vs_trl.py starts it in a process of its own, where `trl` imports; see that script.)

The run's settings come from the nano-miles config, mapped once in `grpo_settings`: prompts per step
(trainer.batch_groups), samples per prompt (rollout.group_size), max new tokens, temperature, top-p,
learning rate (constant, no warm-up), clip range, AdamW, gradient-norm clip, no KL, fp32 or bf16 as
the trainer has it, one optimizer step per generation round and no gradient checkpointing unless the
config asks for it. Prompts are the same text (chat template rendered by nano-miles), checked to
tokenize to the same ids. What is read back from the trainer once it is built, not what was asked
for, goes into the result, so the comparison prints what really ran.

Held-out evaluation is nano-miles' own: greedy, the same test problems, max new tokens and reward
function, every trainer.eval_every steps, with the clock stopped while it runs (TRL has no such
evaluation; the time is not counted against it). The clock starts when step 1 starts, as the
nano-miles runs' does. Generation and scoring are timed by wrapping the trainer's own methods.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from nano_miles.run.cli import ArgumentParser, UserError, run
from nano_miles.run.config import parse_config

GENERATION_PATHS = {"generate": False, "paged": True}  # -> use_transformers_continuous_batching


def grpo_settings(cfg, out_dir: Path, generation: str) -> dict:
    """GRPOConfig keyword arguments that make TRL run what the nano-miles config describes."""
    t, r = cfg.trainer, cfg.rollout
    return dict(
        output_dir=str(out_dir), report_to="none", save_strategy="no", logging_steps=1, seed=cfg.run.seed,
        max_steps=t.num_steps, num_generations=r.group_size,
        per_device_train_batch_size=t.batch_groups * r.group_size, gradient_accumulation_steps=1,
        num_iterations=1, max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
        top_k=max(r.top_k, 0), learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm, epsilon=t.eps_clip,
        epsilon_high=t.eps_clip_high, beta=t.kl_coef, loss_type="dapo", scale_rewards="group",
        bf16=t.dtype == "bfloat16", gradient_checkpointing=t.gradient_checkpointing,
        use_cpu=t.device == "cpu", use_transformers_continuous_batching=GENERATION_PATHS[generation],
        shuffle_dataset=True, remove_unused_columns=False)


# settings that must be the same on both sides; the others differ by design and are printed as such
MUST_MATCH = ("prompts_per_step", "samples_per_prompt", "samples_per_step", "max_new_tokens", "temperature",
              "top_p", "top_k", "lr", "lr_schedule", "lr_warmup_steps", "optimizer", "weight_decay",
              "max_grad_norm", "clip", "kl_coef", "trainer_dtype", "gradient_checkpointing", "num_steps", "seed")


def nano_settings(cfg) -> dict:
    """nano-miles' side of the comparison, from the merged config (and torch's AdamW defaults, which
    the trainer's optimizer takes)."""
    import torch
    t, r = cfg.trainer, cfg.rollout
    adam = torch.optim.AdamW([torch.zeros(1)], lr=t.lr).defaults
    return {"prompts_per_step": t.batch_groups, "samples_per_prompt": r.group_size,
            "samples_per_step": t.batch_groups * r.group_size, "optimizer_steps_per_generation": 1,
            "max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "top_p": r.top_p,
            "top_k": max(r.top_k, 0), "lr": t.lr, "lr_schedule": t.lr_schedule, "lr_warmup_steps": t.lr_warmup_steps,
            "optimizer": f"AdamW betas={tuple(adam['betas'])} eps={adam['eps']:g}", "weight_decay": t.weight_decay,
            "max_grad_norm": t.max_grad_norm, "clip": [t.eps_clip, t.eps_clip_high], "kl_coef": t.kl_coef,
            "loss": f"token mean over the step, dual clip c={t.dual_clip_c:g}",
            "advantage": "(r - mean) / (std + 1e-6), std per group, n",
            "trainer_dtype": "bfloat16 autocast" if t.dtype == "bfloat16" else t.dtype,
            "gradient_checkpointing": t.gradient_checkpointing, "num_steps": t.num_steps, "seed": cfg.run.seed,
            "generation": (f"SGLang ({cfg.engine.dtype})" if cfg.engine.kind == "sglang" else
                           f"the local engine ({cfg.engine.dtype})") + ", weights pushed after every step"
                          + (", pi_old recomputed by the trainer" if t.recompute_old_logprobs else "")}


def effective_settings(trainer, optimizer) -> dict:
    """What the built trainer will run with, read from it (these go beside nano-miles' settings)."""
    a, g = trainer.args, optimizer.param_groups[0]
    return {"prompts_per_step": a.per_device_train_batch_size // trainer.num_generations,
            "samples_per_prompt": trainer.num_generations,
            "samples_per_step": a.per_device_train_batch_size * a.gradient_accumulation_steps,
            "optimizer_steps_per_generation": a.gradient_accumulation_steps // a.steps_per_generation,
            "max_new_tokens": trainer.max_completion_length, "temperature": trainer.temperature,
            "top_p": trainer.top_p, "top_k": trainer.top_k or 0, "lr": g["lr"],
            "lr_schedule": str(getattr(a.lr_scheduler_type, "value", a.lr_scheduler_type)), "lr_warmup_steps": a.warmup_steps,
            "optimizer": f"{type(optimizer.optimizer if hasattr(optimizer, 'optimizer') else optimizer).__name__} "
                         f"betas={tuple(g['betas'])} eps={g['eps']:g}",
            "weight_decay": g["weight_decay"], "max_grad_norm": a.max_grad_norm,
            "clip": [trainer.epsilon_low, trainer.epsilon_high], "kl_coef": trainer.beta,
            "loss": f"{trainer.loss_type}: token mean over the step", "advantage": f"(r - mean) / (std + 1e-4), "
            f"std {'per group, n-1' if a.scale_rewards == 'group' else a.scale_rewards}",
            "trainer_dtype": "bfloat16 autocast" if a.bf16 else str(next(trainer.model.parameters()).dtype)[6:],
            "gradient_checkpointing": a.gradient_checkpointing, "num_steps": a.max_steps, "seed": a.seed,
            "generation": "transformers continuous batching (paged)" if a.use_transformers_continuous_batching
            else "model.generate, the trained weights in place"}


class Clock:
    """Training wall time: starts with step 1, stops while `paused()` (the held-out evaluation)."""

    def __init__(self, sync):
        self.sync, self.start_s, self.paused_s = sync, None, 0.0

    def start(self) -> None:
        if self.start_s is None:
            self.start_s = time.perf_counter()

    def elapsed_s(self) -> float:
        return 0.0 if self.start_s is None else time.perf_counter() - self.start_s - self.paused_s

    def synced(self, fn, *args, **kwargs) -> tuple[object, float]:
        """fn's result and its wall time, the device synced before and after."""
        self.sync()
        start_s = time.perf_counter()
        out = fn(*args, **kwargs)
        self.sync()
        return out, time.perf_counter() - start_s

    def timed(self, fn, name: str, times: dict):
        """`fn`, adding its wall time to times[name]."""
        def wrapper(*args, **kwargs):
            out, seconds = self.synced(fn, *args, **kwargs)
            times[name] = times.get(name, 0.0) + seconds
            return out
        return wrapper

    def paused(self, fn, *args):
        """fn(*args) off the clock."""
        out, seconds = self.synced(fn, *args)
        if self.start_s is not None:
            self.paused_s += seconds
        return out


class Task:
    """The config's task for TRL: the train prompts as text and labels, and nano-miles' held-out
    evaluation (greedy, the same problems, max new tokens and reward function)."""

    def __init__(self, cfg, tokenizer):
        from nano_miles.rewards import load_reward
        from nano_miles.tasks import load_problems
        from nano_miles.tasks.prompts import encode_prompts, prompt_text
        self.cfg, self.tokenizer, self.reward_fn = cfg, tokenizer, load_reward(cfg.reward)
        train, self.test = load_problems(cfg, "train"), load_problems(cfg, "test")
        self.texts = [prompt_text(tokenizer, p.prompt, chat_template=cfg.task.chat_template,
                                  system_prompt=cfg.task.system_prompt) for p in train]
        self.labels = [p.answer for p in train]
        # TRL tokenizes the text itself: it must come to the ids nano-miles sends the engine
        for text, ids in zip(self.texts[:64], encode_prompts(tokenizer, train[:64], cfg.task)):
            if tokenizer(text)["input_ids"] != ids:
                raise SystemExit(f"TRL would tokenize {text!r} to other ids than nano-miles sends")
        self.test_ids = encode_prompts(tokenizer, self.test, cfg.task)
        self.counts = {"num_samples": 0, "num_tokens": 0, "reward": 0.0}

    def reward(self, completions, completion_ids, label, **_) -> list[float]:
        """TRL's reward function: the config's, on the decoded completions; counts what it scored."""
        scores = [float(self.reward_fn(c, lbl)["reward"]) for c, lbl in zip(completions, label)]
        self.counts["num_samples"] += len(completions)
        self.counts["num_tokens"] += sum(len(ids) for ids in completion_ids)
        self.counts["reward"] += sum(scores)
        return scores

    def accuracy(self, model) -> float:
        from nano_miles.policy.evaluate import generate
        was_training = model.training
        model.eval()
        outs = generate(model, self.tokenizer, self.test_ids, num_samples=1, temperature=0.0,
                        max_new_tokens=self.cfg.rollout.max_new_tokens)
        model.train(was_training)
        solved = [self.reward_fn(o[0], p.answer).get("accuracy", 0.0) for o, p in zip(outs, self.test)]
        return sum(solved) / len(solved)


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m harness.trl_grpo", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="the result file (JSON)")
    parser.add_argument("--generation", choices=tuple(GENERATION_PATHS), default="generate",
                        help="TRL's generation path without vLLM: model.generate (default) or transformers' "
                             "paged continuous batching")
    cfg, args = parse_config(argv, parser)
    try:
        import torch
        import trl
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, TrainerCallback
    except ImportError as e:
        raise UserError(f"TRL's GRPOTrainer needs trl and datasets importable ({e}); "
                        "pip install trl (or bash bench/trl_bundle.sh for a host without network)") from None
    from nano_miles.tasks.prompts import load_tokenizer

    device = torch.device(cfg.trainer.device)
    clock = Clock(torch.cuda.synchronize if device.type == "cuda" else (lambda: None))
    tokenizer = load_tokenizer(cfg.model_dir)
    task = Task(cfg, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32).to(device)
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=task.reward, processing_class=tokenizer,
        args=trl.GRPOConfig(**grpo_settings(cfg, args.out.parent / "trl_output", args.generation)),
        train_dataset=Dataset.from_dict({"prompt": task.texts, "label": task.labels}))
    phase_s: dict[str, float] = {}
    trainer._generate = clock.timed(trainer._generate, "generate", phase_s)
    trainer._calculate_rewards = clock.timed(trainer._calculate_rewards, "score", phase_s)
    result = {"settings": None, "trl_version": trl.__version__, "steps": [], "evals": []}

    def evaluate(step: int) -> None:
        accuracy = clock.paused(task.accuracy, trainer.model)
        result["evals"].append({"step": step, "accuracy": accuracy, "elapsed_s": clock.elapsed_s()})
        print(f"step {step}: held-out accuracy {100 * accuracy:.1f}% at {clock.elapsed_s():.1f}s", flush=True)

    class Measure(TrainerCallback):
        def on_train_begin(self, args_, state, control, optimizer=None, **_):
            result["settings"] = effective_settings(trainer, optimizer)
            evaluate(0)

        def on_step_begin(self, args_, state, control, **_):
            clock.sync()
            clock.start()
            self.step_start_s = clock.elapsed_s()
            phase_s.clear()
            task.counts.update(num_samples=0, num_tokens=0, reward=0.0)

        def on_step_end(self, args_, state, control, **_):
            clock.sync()
            step_s, n = clock.elapsed_s() - self.step_start_s, task.counts["num_samples"]
            result["steps"].append({
                "step": state.global_step, "step_s": step_s, "elapsed_s": clock.elapsed_s(),
                "reward": task.counts["reward"] / max(n, 1), "num_samples": n, "num_tokens": task.counts["num_tokens"],
                "phase_s": {"generate": phase_s.get("generate", 0.0), "score": phase_s.get("score", 0.0),
                            "train": step_s - sum(phase_s.values())}})
            print(f"step {state.global_step}/{state.max_steps}: {step_s:.2f}s, {n} samples "
                  f"(generate {phase_s.get('generate', 0.0):.2f}s)", flush=True)
            every = cfg.trainer.eval_every  # as nano-miles' trainer: 0 = only before step 1 and after the last
            if state.global_step == state.max_steps or (every > 0 and state.global_step % every == 0):
                evaluate(state.global_step)

    trainer.add_callback(Measure())
    trainer.train()
    result["train_s"] = clock.elapsed_s()
    result["peak_memory_mb"] = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    run(main, "trl_grpo")
