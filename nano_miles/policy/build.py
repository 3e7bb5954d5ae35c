"""Builds the small policy: a Qwen2 causal LM from a seed, a short supervised warm-up, saved as an HF directory.
Used as a library (`build_policy(out_dir)`) and by `python -m nano_miles.policy build|sweep`.

The warm-up stops early on purpose, so that greedy accuracy starts low while sampling still finds
answers: RL then has both room and a signal. It teaches every format of `formats.py`, one per step
in turn, so each batch has one prompt layout and little padding.
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path
from typing import NamedTuple

from nano_miles.policy.formats import FORMATS, encode_prompt, format_expressions, format_problem, tag_first_step
from nano_miles.policy.tokenizer import EOS, IM_END, MAX_POSITIONS, PAD, UNK, VOCAB, build_tokenizer
from nano_miles.tasks.prompts import turn_ids

# "small" is the shipped CPU policy. "medium" (3.2 M parameters, 4x) is the quick GPU demo: its
# warm-up takes a minute on one GPU, and it can learn the task to high accuracy. "large" (39.5 M) is
# big enough that a GPU's training step costs about what generation does.
MODEL_SHAPES = {
    "small": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS),
    "medium": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=MAX_POSITIONS),
    "large": dict(hidden_size=640, intermediate_size=1920, num_hidden_layers=8,
                  num_attention_heads=10, num_key_value_heads=5, max_position_embeddings=MAX_POSITIONS),
}


class Warmup(NamedTuple):
    """A shape's supervised warm-up. The step counts were picked once from a sweep (see
    assets/policy/README.md and bench/results/gpu/README.md) and are fixed, so a build never looks at
    test accuracy."""

    num_steps: int
    batch_size: int
    peak_lr: float
    formats: tuple[str, ...]
    # The share of taught answers that tag the first step's result instead of the final one. A
    # teacher with this habit leaves the policy a wrong mode that sampling escapes now and then:
    # greedy accuracy starts far below pass@k, and RL has a habit to find and drop on top of
    # sharpening what the policy can compute (docs/design-notes.md, "The small policy's teacher has a
    # habit RL can drop"). 0 is the plain teacher.
    first_step_answer_rate: float = 0.0


# The small policy serves every CPU run (plain, chat, word problems); the medium one is the GPU demo
# of the plain task; the large one the GPU's real curve on it, from a start far below its pass@k.
WARMUP = {"small": Warmup(1050, 64, 3e-3, ("raw", "chat", "word"), first_step_answer_rate=0.6),
          "medium": Warmup(450, 256, 1e-3, ("raw",)),
          "large": Warmup(900, 256, 1e-3, ("raw",), first_step_answer_rate=0.6)}
NUM_LR_RAMP_STEPS = 20


def build_model(seed: int, shape: str = "small"):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(VOCAB), tie_word_embeddings=True, pad_token_id=VOCAB.index(PAD),
                         eos_token_id=VOCAB.index(EOS), bos_token_id=None, **MODEL_SHAPES[shape])
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float()
    # a response ends at EOS or at the end of a chat turn (generation_config.json lists both, as
    # Qwen2.5-Instruct's does)
    model.generation_config.eos_token_id = [VOCAB.index(EOS), VOCAB.index(IM_END)]
    return model


def make_batch(tokenizer, fmt: str, expressions, is_first_step_answer=None) -> dict:
    """Right-padded prompt + response + end token in format `fmt`; labels are -100 except on the
    model's turns and their end tokens (a tool's turn between them is read, not taught). Where
    `is_first_step_answer[i]`, row i's answer is the first step's (formats of one turn)."""
    import torch

    is_chat, end = FORMATS[fmt]
    end_id = tokenizer.convert_tokens_to_ids(end)
    rows, label_rows = [], []
    for i, e in enumerate(expressions):
        problem, response = format_problem(fmt, e)
        if isinstance(response, str):
            if is_first_step_answer is not None and is_first_step_answer[i]:
                response = tag_first_step(response, e)
            response = [(response, True)]
        prompt_ids = encode_prompt(tokenizer, problem, chat_template=is_chat)
        row, labels = list(prompt_ids), [-100] * len(prompt_ids)
        for text, is_model in response:  # each turn as the pipeline appends it: the model's, or the tool's
            if is_model:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [end_id]
            else:
                ids = turn_ids(tokenizer, {"role": "tool", "content": text})
            row += ids
            labels += ids if is_model else [-100] * len(ids)
        rows.append(row)
        label_rows.append(labels)
    max_len = max(len(r) for r in rows)
    pad = lambda r, v: r + [v] * (max_len - len(r))  # noqa: E731
    return {
        "input_ids": torch.tensor([pad(r, tokenizer.pad_token_id) for r in rows]),
        "attention_mask": torch.tensor([pad([1] * len(r), 0) for r in rows]),
        "labels": torch.tensor([pad(r, -100) for r in label_rows]),
    }


def lr_at(step: int, peak_lr: float) -> float:
    """Linear ramp, then constant: a run stopped at step k equals the first k steps of a longer one,
    so the stopping step could be chosen from a single long sweep."""
    return peak_lr * min(1.0, (step + 1) / NUM_LR_RAMP_STEPS)


def warm_up(model, tokenizer, *, seed: int, num_steps: int, batch_size: int, peak_lr: float,
            formats: tuple[str, ...] = tuple(FORMATS), first_step_answer_rate: float = 0.0,
            on_step=None) -> None:
    """Supervised warm-up on train problems in a seeded order (cycled if steps outrun the split),
    one of `formats` per step in turn; each answer is the first step's with probability
    `first_step_answer_rate`, drawn per row from the seed."""
    import torch

    pools = {fmt: format_expressions(fmt, "train", seed) for fmt in formats}
    habit = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    start_s = time.monotonic()
    for step in range(num_steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, peak_lr)
        fmt = formats[step % len(formats)]
        pool, first = pools[fmt], (step // len(formats)) * batch_size
        is_first_step_answer = [habit.random() < first_step_answer_rate for _ in range(batch_size)]
        batch = make_batch(tokenizer, fmt, [pool[i % len(pool)] for i in range(first, first + batch_size)],
                           is_first_step_answer)
        loss = model(**{k: v.to(model.device) for k, v in batch.items()}).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0 or step == num_steps - 1:
            elapsed_s = time.monotonic() - start_s
            eta_s = elapsed_s / (step + 1) * (num_steps - step - 1)
            print(f"warm-up step {step + 1}/{num_steps} ({fmt}) loss {loss.item():.4f} "
                  f"elapsed {elapsed_s:.0f}s eta {eta_s:.0f}s", flush=True)
        if on_step is not None:
            on_step(step + 1, model)
    model.eval()


def save_policy(model, tokenizer, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # Name the class transformers would pick for a qwen2 model anyway, so every version loads alike.
    config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "Qwen2Tokenizer"
    config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    special = {"eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def warmed_up_model(tokenizer, *, seed: int, shape: str, num_steps: int | None, device: str, on_step=None,
                    formats: tuple[str, ...] | None = None, init_dir: Path | None = None,
                    first_step_answer_rate: float | None = None):
    """The model of `shape` from `seed` after its warm-up (the shape's schedule; `num_steps`, `formats`
    and `first_step_answer_rate` if given). With `init_dir` the warm-up goes on from that policy instead of new weights:
    how a policy built for one format is taught another (the large one, word problems)."""
    from transformers import AutoModelForCausalLM

    warmup = WARMUP[shape]
    model = (build_model(seed, shape) if init_dir is None else
             AutoModelForCausalLM.from_pretrained(init_dir, dtype="float32")).to(device)
    warm_up(model, tokenizer, seed=seed, num_steps=warmup.num_steps if num_steps is None else num_steps,
            batch_size=warmup.batch_size, peak_lr=warmup.peak_lr, formats=formats or warmup.formats,
            first_step_answer_rate=(warmup.first_step_answer_rate if first_step_answer_rate is None
                                    else first_step_answer_rate), on_step=on_step)
    return model


def build_policy(out_dir, *, seed: int = 0, shape: str = "small", num_steps: int | None = None,
                 device: str = "cpu", formats: tuple[str, ...] | None = None, init_dir: Path | None = None,
                 first_step_answer_rate: float | None = None) -> Path:
    """Build the tokenizer and model from `seed` (or `init_dir`'s model), warm up, save to `out_dir`."""
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    model = warmed_up_model(tokenizer, seed=seed, shape=shape, num_steps=num_steps, device=device,
                            formats=formats, init_dir=init_dir, first_step_answer_rate=first_step_answer_rate)
    save_policy(model.cpu(), tokenizer, out_dir)
    return out_dir


def sweep(out_dir: Path, *, shape: str, num_steps: int, eval_every: int, device: str, seed: int = 0,
          num_eval: int = 200, num_samples: int = 8, formats: tuple[str, ...] | None = None,
          init_dir: Path | None = None, first_step_answer_rate: float | None = None) -> list[dict]:
    """One long warm-up, evaluated in every format every `eval_every` steps; each evaluated snapshot
    is saved as out_dir/step<N>, the table as out_dir/sweep.json. With the constant learning rate
    after the ramp, snapshot N is exactly what `build --num-steps N` makes, so a step count can be
    picked from here."""
    import torch

    from nano_miles.policy.evaluate import evaluate_formats

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, rows = build_tokenizer(), []
    start_s = time.monotonic()

    def on_step(step: int, model) -> None:
        if step % eval_every and step != num_steps:
            return
        model.eval()
        torch.manual_seed(seed)
        row = {"step": step, "warmup_s": round(time.monotonic() - start_s, 1),
               **evaluate_formats(model, tokenizer, num_eval, num_samples=num_samples,
                                  formats=formats or WARMUP[shape].formats)}
        model.train()
        save_policy(copy.deepcopy(model).cpu(), tokenizer, out_dir / f"step{step}")
        rows.append(row)
        (out_dir / "sweep.json").write_text(json.dumps({"shape": shape, "seed": seed, "rows": rows}, indent=2))
        print("sweep " + " ".join(f"{k} {v}" for k, v in row.items()), flush=True)

    warmed_up_model(tokenizer, seed=seed, shape=shape, num_steps=num_steps, device=device, on_step=on_step,
                    formats=formats, init_dir=init_dir, first_step_answer_rate=first_step_answer_rate)
    return rows
