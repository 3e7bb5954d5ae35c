"""The trainer's run record: one typed record per step, and what a finished run leaves in its directory.

Library module; the trainer owns one `RunRecord` and writes it. In the run directory:

    metrics.jsonl   one `StepRecord` per step (a step redone after a restart is written again; the
                    last record of a step wins when the file is read back)
    summary.json    early vs late reward, held-out accuracy start / max / end, timings, the ledger's counts
    ledger.json     every prompt of the run: trained once (at which step), or why not
    queues.jsonl    every hop's queue depth once a second (`queues.py`), plotted at the end (`plots.py`)
    rollouts.jsonl  with `metrics.save_rollouts`: every group trained, one line each (`rollout_line`)
    samples.jsonl   `metrics.samples_per_step` whole samples per step, as text (`sample_lines`);
                    `python -m nano_miles.observe.samples RUN_DIR` prints the latest

and the optional TensorBoard / W&B sinks (`sinks.py`) get each step's numbers.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nano_miles.algo.diagnostics import StepStats, declared, shown
from nano_miles.observe.plots import write_plots
from nano_miles.observe.queues import QueueRecorder
from nano_miles.observe.sinks import make_sinks, scalars
from nano_miles.run.identity import FINISHED_FILE
from nano_miles.wire.codec import group_id_at, position_of


@dataclass
class StepRecord:
    """One training step as metrics.jsonl stores it (flat: the batch statistics sit beside the rest)."""

    step: int
    version: int                  # weight version after this step (= step)
    stats: StepStats
    wait_s: float                 # pulling the batch: generation, scoring and waiting
    update_split_ms: dict         # weight update by part: pause, gather, serialize, apply, resume
    queue_depth: int              # groups sent downstream by the producer, not yet trained or dropped
    goodput: float | None         # trained / generated response tokens so far
    num_generated_tokens: int     # the producer's count of generated response tokens so far (goodput's
                                  # denominator; a restarted trainer goes on from the newest record's)
    num_resumed_samples: int      # sample segments resumed after an abort-mode pause, so far
    group_ids: list[str]          # the groups this step trained
    drops: dict                   # reason -> groups the trainer dropped so far
    step_s: float = 0.0
    elapsed_s: float = 0.0        # training wall time since step 1 (across restarts)
    eval_s: float = 0.0
    evaluation: dict | None = None  # on evaluation steps: `evaluate.EvalResult.as_dict`
    phase_s: dict = field(default_factory=dict)  # the step split by phase (`step_phases`)

    def to_json(self) -> dict:
        out = {"step": self.step, "version": self.version, "wait_s": self.wait_s, **self.stats.as_dict(),
               "update_split_ms": self.update_split_ms, "queue_depth": self.queue_depth,
               "goodput": self.goodput, "num_generated_tokens": self.num_generated_tokens,
               "num_resumed_samples": self.num_resumed_samples,
               "group_ids": self.group_ids, "eval_s": self.eval_s, "step_s": self.step_s,
               "elapsed_s": self.elapsed_s, "drops": self.drops, "phase_s": self.phase_s}
        return {**out, **eval_columns(self.evaluation or {})}


def eval_columns(evaluation: dict) -> dict:
    """An evaluation's figures as metrics.jsonl keeps them: eval_accuracy, eval_reward, eval_pass_at_k
    and eval_<part> for every other reward part (those a reward function does not have left out)."""
    figures = {k: v for k, v in evaluation.items() if k not in ("step", "elapsed_s", "k", "parts")}
    return {f"eval_{k}": v for k, v in {**figures, **evaluation.get("parts", {})}.items() if v is not None}


def step_phases(record: StepRecord, received_times: list[tuple[float, float, float]]) -> dict[str, float]:
    """The step split into generate, score, waiting (the pull), train, update and eval.

    `received_times` are (issued, generated, received) unix times of the groups pulled. Generate runs
    from the first issue to the last generation, score from there to the last receipt (the producer's
    pick-up, both hops and the reward function), waiting is the rest of the pull; train is what
    remains of the step after pull, update and eval. In async mode groups are generated before the
    pull starts, so generate is ~0 there: the trainer did not wait for it."""
    step_s, wait_s = record.step_s, record.wait_s
    update_s, eval_s = record.stats.update_ms / 1000, record.eval_s
    pull_start = time.time() - step_s
    times = [t for t in received_times if t[2] >= pull_start] or received_times
    generate_s = score_s = 0.0
    if times:
        first_issued = max(pull_start, min(t[0] for t in times))
        last_generated = max(t[1] for t in times)
        generate_s = min(wait_s, max(0.0, last_generated - first_issued))
        score_s = min(wait_s - generate_s, max(0.0, max(t[2] for t in times) - last_generated))
    return {"generate": generate_s, "score": score_s, "waiting": wait_s - generate_s - score_s,
            "train": max(0.0, step_s - wait_s - update_s - eval_s), "update": update_s, "eval": eval_s}


def format_step_line(r: dict, num_steps: int) -> str:
    """One step of metrics.jsonl as the trainer logs it: every diagnostic with a `line`, then where
    its samples came from, the queue and the step time."""
    texts = [shown(f, r.get(f.name)) for f in declared(StepStats)]
    line = " | ".join([f"step {r['step']:>4}/{num_steps}", *(t for t in texts if t is not None),
                       f"stale {r['staleness_max']} (v{r['version_oldest']} -> v{r['step'] - 1})",
                       f"queue {r.get('queue_depth', 0)}", f"step {r['step_s']:.2f}s"])
    if r.get("eval_accuracy") is not None:
        line += f" | held-out {100 * r['eval_accuracy']:.1f}%"
    elif r.get("eval_reward") is not None:
        line += f" | held-out reward {r['eval_reward']:.3f}"
    return line


def merge_hists(hists) -> dict:
    total: dict[str, int] = {}
    for h in hists:
        for k, v in h.items():
            total[k] = total.get(k, 0) + v
    return dict(sorted(total.items(), key=lambda kv: int(kv[0])))


def ledger_report(state, outstanding: list[str], num_items: int,
                  dropped_for_good: dict[str, str] | None = None) -> dict:
    """Every prompt of the run: trained once (at which step), or why not. `num_items` is the size of
    the train split, which maps ids to positions; `outstanding` are ids the producer still had out at
    the end; `dropped_for_good` are ids the producer gave up on, with the reason."""
    dropped_for_good = dropped_for_good or {}
    trained_at: dict[str, list[int]] = {}
    for step, ids in state.trained_by_step.items():
        for group_id in ids:
            trained_at.setdefault(group_id, []).append(step)
    unfinished = set(outstanding)
    num_prompts = max([state.cursor] + [position_of(g, num_items) + 1 for g in unfinished | set(dropped_for_good)])
    prompts = {}
    for position in range(num_prompts):
        group_id = group_id_at(position, num_items)
        steps = trained_at.get(group_id, [])
        if steps:
            prompts[group_id] = f"trained at step {steps[0]}" + (f" and again at {steps[1:]}" if steps[1:] else "")
        elif group_id in dropped_for_good:
            prompts[group_id] = f"dropped: {dropped_for_good[group_id]}"
        elif group_id in unfinished:
            prompts[group_id] = "dropped: still being generated when the run ended"
        else:
            prompts[group_id] = "lost"
    values = list(prompts.values())
    return {"num_prompts": num_prompts,
            "num_trained_once": sum(v.startswith("trained") and "again" not in v for v in values),
            "num_trained_twice": sum("again" in v for v in values),
            "num_unfinished": sum(v.startswith("dropped: still") for v in values),
            "num_dropped": sum(v.startswith("dropped") and not v.startswith("dropped: still") for v in values),
            "num_lost": values.count("lost"), "prompts": prompts}


def summarize(steps: list[dict], evals: list[dict]) -> dict:
    """Early vs late mean reward, held-out accuracy and reward at start / max / end, and the gains.

    `evals` are `evaluate.EvalResult.as_dict`s; accuracy is None for a reward function without an
    accuracy part, and so are the summary's accuracy figures then. Every other reward part's held-out
    mean is summarized at start and end as eval_<part>_start / _end (e.g. eval_first_step_start)."""
    window = max(1, len(steps) // 5)
    early = float(np.mean([r["reward"] for r in steps[:window]])) if steps else float("nan")
    late = float(np.mean([r["reward"] for r in steps[-window:]])) if steps else float("nan")
    columns = [eval_columns(e) for e in evals]

    def start_max_end(key: str) -> tuple:
        values = [c[key] for c in columns if key in c]
        return (values[0], max(values), values[-1]) if values else (None, None, None)
    acc_start, acc_max, acc_end = start_max_end("eval_accuracy")
    reward_start, reward_max, reward_end = start_max_end("eval_reward")
    part_names = sorted({name for e in evals for name in e.get("parts", {})})
    parts = {f"eval_{name}_{when}": value for name in part_names
             for when, value in zip(("start", "end"), start_max_end(f"eval_{name}")[::2])}
    return {
        "num_steps": len(steps),
        "reward_early": early, "reward_late": late, "reward_delta": late - early,
        "eval_accuracy_start": acc_start, "eval_accuracy_max": acc_max, "eval_accuracy_end": acc_end,
        "eval_accuracy_delta": None if acc_start is None else acc_max - acc_start,
        "eval_reward_start": reward_start, "eval_reward_max": reward_max, "eval_reward_end": reward_end,
        "eval_pass_at_k_end": start_max_end("eval_pass_at_k")[2], **parts,
        "staleness_max": max((r["staleness_max"] for r in steps), default=0),
        "staleness_hist": merge_hists(r["staleness_hist"] for r in steps),
        "goodput": steps[-1].get("goodput") if steps else None,
        "drops": steps[-1].get("drops", {}) if steps else {},
        "mean_step_s": float(np.mean([r["step_s"] for r in steps])) if steps else float("nan"),
        "mean_update_ms": float(np.mean([r["update_ms"] for r in steps])) if steps else float("nan"),
        "evals": evals,
    }


def rollout_line(step: int, scored, advantages) -> dict:
    """One trained group as rollouts.jsonl keeps it: the ids the trainer saw, their rewards and
    advantages, and the behaviour logprobs, for inspecting a run and comparing two runs token by token."""
    group = scored.group
    return {"step": step, "group_id": group.group_id, "attempt": group.attempt,
            "label": group.metadata.get("label"), "prompt_ids": group.prompt_tokens.tolist(),
            "samples": [{"response_ids": s.response_tokens.tolist(), "logprobs": s.logprobs.tolist(),
                         "versions": s.versions.tolist(), "finish_reason": s.finish_reason,
                         "reward": float(r), "advantage": float(a), **_mask_of(s)}
                        for s, r, a in zip(group.samples, scored.rewards, advantages)]}


def _mask_of(sample) -> dict:
    """A trajectory's loss mask, where some of its tokens are the environment's (none to show otherwise)."""
    mask = sample.model_mask
    return {} if mask.all() else {"loss_mask": mask.astype(int).tolist()}


def sample_lines(step: int, scored, advantages, decode, num: int) -> list[dict]:
    """The first `num` samples of a step's groups, one per group in turn, as text: the prompt exactly
    as sent (template and special tokens included), the response as generated (stop token included)."""
    picked = [(g, a, i) for i in range(max((len(g.group.samples) for g in scored), default=0))
              for g, a in zip(scored, advantages) if i < len(g.group.samples)][:num]
    lines = []
    for g, a, i in picked:
        sample = g.group.samples[i]
        turns = sample.turns
        lines.append({"step": step, "group_id": g.group.group_id, "sample": i, "version": sample.oldest_version,
                      "label": g.group.metadata.get("label"), "prompt": decode(g.group.prompt_tokens),
                      "response": decode(sample.response_tokens), "num_prompt_tokens": len(g.group.prompt_tokens),
                      "num_response_tokens": len(sample.response_tokens), "finish_reason": sample.finish_reason,
                      "reward": float(g.rewards[i]), "advantage": float(a[i]),
                      "reward_parts": {k: float(v[i]) for k, v in sorted(g.reward_parts.items())},
                      # several turns: each one's text, and whether its tokens trained (the model's did)
                      **({"turns": [{"trained": is_model, "text": decode(sample.response_tokens[a:b])}
                                    for a, b, is_model in turns]} if len(turns) > 1 else {})})
    return lines


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file; a last line without its newline is one still being written (a
    live run's), and is left for the next read."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    return [json.loads(line) for line in lines[:-1] if line]


class RunRecord:
    """Everything of the run directory the trainer writes, besides checkpoints and its log."""

    def __init__(self, cfg, decode):
        self.run_dir, self.is_plotted = cfg.run_dir, cfg.metrics.plots
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.rollouts_path = self.run_dir / "rollouts.jsonl" if cfg.metrics.save_rollouts else None
        self.samples_path, self.num_samples = self.run_dir / "samples.jsonl", cfg.metrics.samples_per_step
        self.decode = decode  # token ids -> text with special tokens kept
        self.sinks = make_sinks(cfg)
        self.recorder = None
        if cfg.metrics.queue_sample_s > 0:
            self.recorder = QueueRecorder(cfg, self.run_dir / "queues.jsonl", cfg.metrics.queue_sample_s)
            self.recorder.start()

    def write_step(self, record: StepRecord) -> None:
        data = record.to_json()
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({**data, "time": time.time()}) + "\n")
        values = scalars({k: v for k, v in data.items() if k != "step"})
        for sink in self.sinks:
            sink.log(record.step, values)

    def write_rollouts(self, step: int, groups, advantages) -> None:
        """`advantages`: one array per group, as the trainer computed them."""
        if self.rollouts_path is not None:
            with self.rollouts_path.open("a") as f:
                f.writelines(json.dumps(rollout_line(step, g, a)) + "\n" for g, a in zip(groups, advantages))

    def write_samples(self, step: int, groups, advantages) -> None:
        if self.num_samples > 0:
            with self.samples_path.open("a") as f:
                f.writelines(json.dumps(line) + "\n" for line in sample_lines(step, groups, advantages, self.decode,
                                                                              self.num_samples))

    def steps(self, last_step: int) -> list[dict]:
        """One record per step up to `last_step`, of the surviving history (a restart re-does the
        steps after its checkpoint: the newest record of a step wins)."""
        by_step = {r["step"]: r for r in read_jsonl(self.metrics_path) if r["step"] <= last_step}
        return [by_step[k] for k in sorted(by_step)]

    def num_generated_tokens(self) -> int:
        """The producer's generated-token count as the newest step record heard it: a checkpoint does not
        roll it back, and what steps redone after a restart generated the first time was spent too."""
        return max((r.get("num_generated_tokens", 0) for r in read_jsonl(self.metrics_path)), default=0)

    def finish(self, steps: list[dict], summary: dict, ledger: dict) -> None:
        """Write summary.json and ledger.json, stop the queue recorder and the sinks, draw the plots."""
        (self.run_dir / "ledger.json").write_text(json.dumps(ledger, indent=2))
        (self.run_dir / FINISHED_FILE).write_text(json.dumps(summary, indent=2))
        if self.recorder is not None:
            self.recorder.stopped.set()
            self.recorder.join(timeout=5)
        for sink in self.sinks:
            sink.close()
        if self.is_plotted:
            write_plots(self.run_dir, steps, read_jsonl(self.run_dir / "queues.jsonl"))
