"""The reward function run in a child process, with a per-call timeout, so that a raise or a hang
costs one sample, never the stage calling it (the reward stage scores with it, the trainer's
held-out evaluation too), unless the function fails so often that it is broken (`FailureLimit`).
Library module; `tests/test_reward_faults.py` drives it. The child is `nano_miles/run/child.py`'s,
forked (not spawned) so that any callable works, closures included.
"""

from __future__ import annotations

import logging
import math
import queue
from concurrent.futures import ThreadPoolExecutor

from nano_miles.rewards import with_facts
from nano_miles.run.child import TIMEOUT, CallFailed, ChildFunction
from nano_miles.run.cli import UserError

log = logging.getLogger("reward")

REASON_ERROR = "reward_error"          # the function raised, returned garbage, or its worker died
REASON_TIMEOUT = "reward_timeout"      # no answer within the per-sample budget
REASON_NONFINITE = "reward_nonfinite"  # a NaN or infinite reward or part
REASONS = (REASON_ERROR, REASON_TIMEOUT, REASON_NONFINITE)


class RewardFailure(Exception):
    """One sample could not be scored; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def _as_floats(fn):
    """`fn` whose answer is sent back as a plain {name: float} map."""
    def call(response: str, label: str, facts: dict | None) -> dict[str, float]:
        return {str(k): float(v) for k, v in fn(response, label, facts).items()}
    return call


class RewardWorker:
    """Calls `reward_fn(response, label)` in forked children (`nano_miles/run/child.py`), at most
    `timeout_s` per call; with `facts` (`nano_miles.rewards.sample_facts`) what its form asks for. With
    `num_workers` > 1 that many children answer at once: calls from several threads (`score_all`) run
    in parallel, each on a free child, so a slow verifier does not serialize a group."""

    def __init__(self, reward_fn, timeout_s: float, num_workers: int = 1):
        # as a function of (response, label, facts): what `load_reward` returns, or any (response, label) one
        fn = with_facts(reward_fn, "the reward function")
        self.takes_record = fn.takes_record  # whether it reads the prompt, the turns and the record's fields
        self.children = [ChildFunction(_as_floats(fn), timeout_s, name="reward worker") for _ in range(num_workers)]
        self.free: queue.SimpleQueue[ChildFunction] = queue.SimpleQueue()
        for child in self.children:
            self.free.put(child)
        self.threads = ThreadPoolExecutor(num_workers, thread_name_prefix="reward") if num_workers > 1 else None

    @property
    def num_workers(self) -> int:
        return len(self.children)

    @property
    def num_restarts(self) -> int:
        return sum(c.num_restarts for c in self.children)

    def start(self) -> None:
        for child in self.children:
            child.start()

    def stop(self) -> None:
        for child in self.children:
            child.stop()
        if self.threads is not None:
            self.threads.shutdown(wait=False)

    def __call__(self, response: str, label: str, facts: dict | None = None) -> dict[str, float]:
        """The reward and its parts, all finite floats; RewardFailure naming the reason otherwise."""
        child = self.free.get()
        try:
            value = child(response, label, facts)
        except CallFailed as e:
            raise RewardFailure(REASON_TIMEOUT if e.reason == TIMEOUT else REASON_ERROR, e.detail) from None
        finally:
            self.free.put(child)
        if "reward" not in value:
            raise RewardFailure(REASON_ERROR, f"no 'reward' key in {sorted(value)[:8]}")
        bad = [k for k, v in value.items() if not math.isfinite(v)]
        if bad:
            raise RewardFailure(REASON_NONFINITE, f"non-finite {', '.join(f'{k}={value[k]}' for k in bad)}")
        return value


class FailureLimit:
    """Tells a broken reward function from an unlucky sample. `check` after each batch scored (a group
    in the reward stage, a held-out pass in the trainer's evaluation) raises a UserError naming the
    function and its last error when every sample of the batch failed, or when more than
    `max_fraction` of all the samples checked so far did; a failure that costs a sample now and then
    goes on costing that sample only."""

    def __init__(self, what: str, max_fraction: float):
        self.what, self.max_fraction = what, max_fraction  # `what`: the function, as `describe` names it
        self.num_scored = self.num_failed = 0

    def check(self, num_scored: int, failures: list[RewardFailure]) -> None:
        self.num_scored += num_scored
        self.num_failed += len(failures)
        if not failures:
            return
        if len(failures) == num_scored:
            raise UserError(f"{self.what} failed on all {num_scored} samples of a batch; the last: {failures[-1]}")
        if self.num_failed > self.max_fraction * self.num_scored:
            raise UserError(f"{self.what} failed on {self.num_failed} of the {self.num_scored} samples scored, "
                            f"more than reward.max_failure_fraction = {self.max_fraction:g}; the last: "
                            f"{failures[-1]}")


def score(worker: RewardWorker, response: str, label: str, on_failure=None, facts: dict | None = None) -> dict[str, float]:
    """The reward and its parts of one sample; a sample that cannot be scored gets reward 0 (and no
    parts), and `on_failure(failure)` is told why."""
    try:
        return worker(response, label, facts)
    except RewardFailure as failure:
        if on_failure is not None:
            on_failure(failure)
        return {"reward": 0.0}


def score_all(worker: RewardWorker, items: list[tuple[str, str, dict | None]], on_failure=None) -> list[dict[str, float]]:
    """`score` of every (response, label, facts) item, in order, as many at once as `worker` has
    children; `on_failure(index, failure)` hears of each sample that could not be scored."""
    def one(index: int) -> dict[str, float]:
        response, label, facts = items[index]
        return score(worker, response, label, None if on_failure is None else
                     lambda failure: on_failure(index, failure), facts)
    if worker.threads is None or len(items) <= 1:
        return [one(i) for i in range(len(items))]
    return list(worker.threads.map(one, range(len(items))))
