"""Measures a policy directly (no engine): greedy accuracy, format rate and pass@k per format.
Used as a library by the sweep and by `python -m nano_miles.policy eval --model DIR`.
"""

from __future__ import annotations

from nano_miles.policy.formats import FORMATS, encode_prompt, format_problems, format_reward
from nano_miles.tasks import Problem

MAX_NEW_TOKENS = 40


def generate_ids(model, tokenizer, prompts: list[list[int]], *, num_samples: int, temperature: float,
                 max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[list[int]]]:
    """Per prompt, `num_samples` responses as ids (greedy when temperature is 0), each ending with the
    first of the model's EOS ids (generation_config.json) it wrote, that id included."""
    import torch

    eos = set(model.generation_config.eos_token_id)
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        by_length.setdefault(len(ids), []).append(i)
    out: list[list[list[int]]] = [[] for _ in prompts]
    # Equal-length groups need no padding, so no position or mask subtleties.
    for indices in by_length.values():
        input_ids = torch.tensor([prompts[i] for i in indices], device=model.device)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
            else dict(do_sample=False)
        with torch.no_grad():
            seqs = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                  max_new_tokens=max_new_tokens, num_return_sequences=num_samples,
                                  eos_token_id=model.generation_config.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, **sampling)
        responses = []
        for row in seqs[:, input_ids.shape[1]:].tolist():
            end = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            responses.append(row[:end])
        for k, i in enumerate(indices):
            out[i] = responses[k * num_samples:(k + 1) * num_samples]
    return out


def generate(model, tokenizer, prompts: list[list[int]], *, num_samples: int, temperature: float,
             max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[str]]:
    """Per prompt, `num_samples` decoded responses (see `generate_ids`), special tokens dropped."""
    return [tokenizer.batch_decode(group, skip_special_tokens=True) for group in
            generate_ids(model, tokenizer, prompts, num_samples=num_samples, temperature=temperature,
                         max_new_tokens=max_new_tokens)]


def converse(model, tokenizer, prompts: list[list[int]], *, num_samples: int, temperature: float) -> list[list[str]]:
    """The `tool` format's conversations, as `nano_miles.rollouts.tools` holds them with `rollout.max_turns`
    = 2: per prompt, `num_samples` last turns. A first turn that calls the calculator hears its result
    (computed here, in this process) and writes a second turn; one that does not is the last."""
    from nano_miles.rollouts.calculator import calculate
    from nano_miles.rollouts.tools import parse_call
    from nano_miles.tasks.prompts import turn_ids

    first = generate_ids(model, tokenizer, prompts, num_samples=num_samples, temperature=temperature)
    texts = [[tokenizer.decode(ids, skip_special_tokens=True) for ids in group] for group in first]
    pending = [(i, k, prompts[i] + ids + turn_ids(tokenizer, {"role": "tool", "content": calculate(call[1])}))
               for i, group in enumerate(first) for k, ids in enumerate(group)
               if (call := parse_call(texts[i][k])) is not None]
    second = generate(model, tokenizer, [ids for _, _, ids in pending], num_samples=1, temperature=temperature)
    for (i, k, _), (text,) in zip(pending, second):
        texts[i][k] = text
    return texts


def evaluate_model(model, tokenizer, problems: list[Problem], *, fmt: str = "raw",
                   num_samples: int = 8) -> dict[str, float]:
    """Greedy accuracy and format rate, and pass@num_samples at temperature 1, scored by the reward
    function of `fmt`."""
    reward, (is_chat, _) = format_reward(fmt), FORMATS[fmt]
    respond = converse if fmt == "tool" else generate
    prompts = [encode_prompt(tokenizer, p, chat_template=is_chat) for p in problems]
    greedy = [reward(r[0], p.answer) for r, p in
              zip(respond(model, tokenizer, prompts, num_samples=1, temperature=0.0), problems)]
    result = {"greedy_accuracy": sum(s["accuracy"] for s in greedy) / len(problems),
              "format": sum(s["format"] for s in greedy) / len(problems)}
    if num_samples > 0:
        samples = respond(model, tokenizer, prompts, num_samples=num_samples, temperature=1.0)
        is_solved = [any(reward(s, p.answer)["accuracy"] for s in group) for group, p in zip(samples, problems)]
        result[f"pass@{num_samples}"] = sum(is_solved) / len(problems)
    return result


def evaluate_formats(model, tokenizer, num: int, *, num_samples: int = 8,
                     formats: tuple[str, ...] = FORMATS) -> dict[str, float]:
    """`evaluate_model` on `num` test problems of each format; raw's keys plain, the others'
    prefixed with the format (`word/greedy_accuracy`)."""
    result = {}
    for fmt in formats:
        scores = evaluate_model(model, tokenizer, format_problems(fmt, "test", num), fmt=fmt, num_samples=num_samples)
        result.update({k if fmt == "raw" else f"{fmt}/{k}": v for k, v in scores.items()})
    return result


def load_policy(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def evaluate_dir(model_dir, *, num: int = 200, num_samples: int = 8, seed: int = 0) -> dict[str, float]:
    import torch

    torch.manual_seed(seed)
    model, tokenizer = load_policy(model_dir)
    return evaluate_formats(model, tokenizer, num, num_samples=num_samples)
