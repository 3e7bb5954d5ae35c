"""How a problem's prompt becomes the token ids the engine sees, and which ids end a response.
Used as a library by the rollout producer and the trainer's evaluation (and the policy's warm-up).

Prompts are tokenized once, by the producer; from there only ids travel, never re-tokenized. With
`task.chat_template` the prompt goes through the tokenizer's own chat template (a user turn, after
`task.system_prompt` if one is set, and the generation prompt), so an instruct model sees the format
it was tuned on. The rendered text is tokenized without adding special tokens: a template that
wants a BOS writes it itself, and adding another would double it.

Generation stops on ids read from the model, never assumed: the EOS ids of generation_config.json,
the tokenizer's EOS, and, with the template, the token that ends a turn in it (found by rendering
an assistant turn and reading the first special token after its text).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from nano_miles.run.cli import UserError

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles chat templates render
TURN_MARK = "\u2063nano-miles\u2063"  # assistant text no template adds itself (invisible separators)


def load_tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


def chat_messages(prompt, system_prompt: str = "") -> list[dict]:
    """A prompt as the chat the template renders: text becomes one user turn; `system_prompt` goes
    first unless the messages bring their own system turn."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def prompt_text(tokenizer, prompt, *, chat_template: bool, system_prompt: str = "") -> str:
    """The text sent for `prompt`: itself, or rendered by the tokenizer's chat template; a prompt the
    template refuses is a UserError naming it (the rollout producer renders every prompt at its start)."""
    if not chat_template:
        if not isinstance(prompt, str):
            raise UserError("a prompt given as chat messages needs task.chat_template=true")
        return prompt
    if not tokenizer.chat_template:
        raise UserError(f"task.chat_template is true, but the tokenizer of {tokenizer.name_or_path} has no "
                        "chat template")
    from jinja2 import TemplateError
    try:
        return tokenizer.apply_chat_template(chat_messages(prompt, system_prompt), tokenize=False,
                                             add_generation_prompt=True)
    except TemplateError as e:  # the template's own refusal, e.g. of roles that do not alternate
        raise UserError(f"the chat template of {tokenizer.name_or_path} refuses the prompt "
                        f"{str(prompt)[:80]!r}: {e}") from None


def prompt_ids(tokenizer, prompt, *, chat_template: bool, system_prompt: str = "") -> list[int]:
    """The token ids sent for `prompt` (see `prompt_text`): no special tokens added."""
    text = prompt_text(tokenizer, prompt, chat_template=chat_template, system_prompt=system_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_prompts(tokenizer, problems, task_cfg) -> list[list[int]]:
    """Each problem's prompt as token ids, once; from here on only ids travel."""
    return [prompt_ids(tokenizer, p.prompt, chat_template=task_cfg.chat_template,
                       system_prompt=task_cfg.system_prompt) for p in problems]


def end_of_turn_id(tokenizer) -> int | None:
    """The special token the chat template writes right after an assistant's text, if any."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": TURN_MARK}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as e:  # a template that refuses this chat: say so, stop on the EOS ids alone
        log.warning("the chat template cannot render an assistant turn (%s); stopping on EOS ids only", e)
        return None
    after = text[text.find(TURN_MARK) + len(TURN_MARK):] if TURN_MARK in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    return ids[0] if ids and ids[0] in set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder) else None


def turn_ids(tokenizer, message: dict) -> list[int]:
    """The ids a multi-turn rollout appends after the model's turn to open its next one: the rest of
    the template's turn ending (after the end-of-turn token the model generated itself), `message` (a
    tool's result, a user's reply) and the generation prompt. Rendered through the chat template and
    tokenized once, on their own: the turns before them are never rendered or tokenized again.

    Found by rendering a chat with and without `message`; a template that renders earlier turns
    differently once a later one follows cannot be extended token by token, and is a UserError."""
    if not tokenizer.chat_template:
        raise UserError(f"a multi-turn rollout renders turns through the chat template, and the tokenizer of "
                        f"{tokenizer.name_or_path} has none")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": TURN_MARK}]
    before = tokenizer.apply_chat_template(chat, tokenize=False)
    after = tokenizer.apply_chat_template([*chat, message], tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise UserError(f"the chat template of {tokenizer.name_or_path} renders earlier turns differently once a "
                        f"{message.get('role')} turn follows; a multi-turn rollout cannot extend it token by token")
    ending = before[before.find(TURN_MARK) + len(TURN_MARK):]  # e.g. "<|im_end|>\n"
    turn_end = end_of_turn_id(tokenizer)
    if turn_end is not None:  # the model wrote this token itself: its turn stopped on it
        ending = ending.removeprefix(tokenizer.convert_ids_to_tokens(turn_end))
    return tokenizer(ending + after[len(before):], add_special_tokens=False)["input_ids"]


def stop_token_ids(model_dir, tokenizer, *, chat_template: bool) -> list[int]:
    """Every id that ends a response: generation_config.json's EOS ids, the tokenizer's EOS and,
    with the chat template, its end-of-turn token."""
    ids: set[int] = set()
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if chat_template:
        turn_end = end_of_turn_id(tokenizer)
        if turn_end is not None:
            ids.add(turn_end)
    return sorted(int(i) for i in ids)


def make_decoder(tokenizer, *, skip_special_tokens: bool = True):
    """Token ids -> text: for the reward function with special tokens (EOS, end of turn) dropped;
    with them kept to show exactly what was sent and generated."""
    def decode(ids) -> str:
        return tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
    return decode
