"""A multi-turn rollout with a calculator tool (`rollout.fn = "nano_miles.rollouts.tools:rollout"`).
Used as a library through `rollout.fn`; needs a model with a chat template (`task.chat_template = true`).

Each sample is a conversation of up to `rollout.max_turns` model turns. A turn that ends with a call

    <tool_call>(7*4)+12</tool_call>

(the expression itself, or the Qwen2.5 / Hermes convention `<tool_call>{"name": "calculator",
"arguments": {"expression": "(7*4)+12"}}</tool_call>`) is answered: the calculator's result goes back
as a `tool` turn, rendered by the model's chat template and tokenized once (`RolloutEngine.next_turn`), and
the model writes its next turn after it. A turn without a call, a turn cut at the token budget, or
the last turn allowed ends the conversation. Every sample's tool turns are read, never trained.

The calculator (`calculator.py`) runs in its own process with a time limit; only the last call of a
turn is answered. `rollout.max_new_tokens` bounds the whole trajectory after the prompt: a tool turn
that would leave no room for an answer ends the sample as cut at the budget ("length").
"""

from __future__ import annotations

import json
import threading

from nano_miles.rollouts.calculator import Calculator
from nano_miles.rollouts.engine import RolloutEngine
from nano_miles.rollouts.trajectory import Trajectory

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_NAME = "calculator"

_calculator: Calculator | None = None
_calculator_lock = threading.Lock()


def calculator() -> Calculator:
    """The process's calculator, started on first use (one child process shared by every group)."""
    global _calculator
    with _calculator_lock:
        if _calculator is None:
            _calculator = Calculator()
        return _calculator


def parse_call(text: str) -> tuple[str, str] | None:
    """(tool name, expression) of the last tool call in `text`, or None when the text makes no call."""
    start = text.rfind(CALL_OPEN)
    end = text.find(CALL_CLOSE, start)
    if start < 0 or end < 0:
        return None
    body = text[start + len(CALL_OPEN):end].strip()
    if not body.startswith("{"):
        return TOOL_NAME, body
    try:
        call = json.loads(body)
        arguments = call.get("arguments") if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some templates write the arguments as JSON text
            arguments = json.loads(arguments)
    except json.JSONDecodeError:
        return TOOL_NAME, body  # not JSON after all: the calculator says what it makes of it
    if not isinstance(arguments, dict):
        return TOOL_NAME, body
    return str(call.get("name")), str(arguments.get("expression", ""))


def answer(call: tuple[str, str]) -> str:
    """The tool turn's text for a call: the calculator's result (or an error, for the model to read)."""
    name, expression = call
    if name != TOOL_NAME:
        return f"error: unknown tool {name!r} (the one tool is {TOOL_NAME!r})"
    return calculator()(expression)


def rollout(record, engine: RolloutEngine) -> list[Trajectory]:
    trajectories = [Trajectory() for _ in range(engine.group_size)]
    active = list(range(engine.group_size))
    for turn in range(engine.max_turns):
        # every sample still talking goes in one batch: the prompt and its conversation so far, as ids
        generations = engine.generate([record.prompt_ids + trajectories[i].tokens for i in active],
                                      max_new_tokens=[engine.max_new_tokens - len(trajectories[i]) for i in active],
                                      samples=active)
        still_active = []
        for i, generation in zip(active, generations):
            t = trajectories[i].add_generation(generation)
            call = parse_call(engine.decode(generation.tokens)) if generation.finish_reason == "stop" else None
            if call is None or turn == engine.max_turns - 1:
                continue
            tool_turn = engine.next_turn("tool", answer(call))
            if len(t) + len(tool_turn) >= engine.max_new_tokens:  # no room left for the model to answer
                t.finish_reason = "length"
                continue
            t.add_environment(tool_turn)
            still_active.append(i)
        active = still_active
        if not active:
            break
    return trajectories
