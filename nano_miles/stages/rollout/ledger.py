"""The producer's ledger: which groups are out, which the trainer has, which must be issued again.

Library module used by the rollout producer; `tests/test_ledger.py` pins its rules.

A group is named by its dataset position (`group_id_at(position, num_items)`, nano_miles/wire/codec.py),
so every re-issue of a prompt carries the same id and the trainer can drop duplicates by id. States,
as the producer sees them:

    fresh (not yet issued) --issue--> outstanding --trainer's commit--> trained
                 re-issue queue <--lease expired / dropped by the trainer / rolled back--'

The trainer is the only durable party. After either side restarts, `restore` rebuilds this ledger from
the trainer's state: the ids in its model and the data cursor (one past the furthest group it trained).
Every id below the cursor that the trainer does not have is issued again, and so is every group that
has left the producer: a restarted trainer holds none of them, and waiting for their leases would stall
training for `lease_s`. So a group lost in any stage's buffers or in a dead process comes back at once;
an id issued twice is trained at most once. `release` does the same when the producer sees the stage
downstream of it go away. The lease remains the backstop for losses nobody notices.
"""

from __future__ import annotations

import time
from collections import deque

from nano_miles.wire.codec import group_id_at, parse_group_id
from nano_miles.wire.control import NO_SIGNAL


class Ledger:
    def __init__(self, num_items: int, lease_s: float):
        assert num_items >= 1 and lease_s > 0
        self.num_items, self.lease_s = num_items, lease_s
        self.cursor = 0                       # position (epoch * num_items + index) of the next fresh item
        self.outstanding: dict[str, float] = {}  # group id -> monotonic time of its (re)issue
        self.trained: set[str] = set()
        self.reissue: deque[str] = deque()
        self.attempts: dict[str, int] = {}
        self.num_reissued = 0
        self.dropped_for_good: dict[str, str] = {}  # id -> reason; never issued again (e.g. too long)

    # ------------------------------------------------------------ issuing
    def next_group(self, now_s: float | None = None) -> tuple[str, int, int]:
        """(group id, dataset index, attempt) of the next group to issue: re-issues first."""
        now_s = time.monotonic() if now_s is None else now_s
        while self.reissue:
            group_id = self.reissue.popleft()
            if group_id not in self.trained and group_id not in self.outstanding \
                    and group_id not in self.dropped_for_good:
                break
        else:
            group_id = group_id_at(self.cursor, self.num_items)
            self.cursor += 1
        attempt = self.attempts.get(group_id, -1) + 1
        self.attempts[group_id] = attempt
        self.outstanding[group_id] = now_s
        return group_id, parse_group_id(group_id)[1], attempt

    @property
    def num_pending_reissue(self) -> int:
        return len(self.reissue)

    def _queue_again(self, group_id: str) -> None:
        self.outstanding.pop(group_id, None)
        if group_id not in self.trained and group_id not in self.reissue:
            self.reissue.append(group_id)
            self.num_reissued += 1

    # ------------------------------------------------------------ what the trainer tells us
    def on_trained(self, group_ids: list[str]) -> None:
        for group_id in group_ids:
            self.outstanding.pop(group_id, None)
            self.trained.add(group_id)

    def on_dropped(self, attempts: dict[str, int]) -> None:
        """The trainer refused these copies (group id -> attempt; stale, from future weights...): issue
        their groups again. Only a group out from here, and only when the refused copy is the one out:
        after a restart or a lease the group may already be issued again, and that copy is still on
        its way. An id this producer never issued (a stray message) must not enter the dataset order."""
        for group_id, attempt in attempts.items():
            if group_id in self.outstanding and self.attempts.get(group_id) == attempt:
                self._queue_again(group_id)

    def on_dropped_for_good(self, group_id: str, reason: str) -> None:
        """A group that can never succeed (the engine refuses its prompt): out of the run, with why."""
        self.outstanding.pop(group_id, None)
        self.dropped_for_good[group_id] = reason

    def renew(self, group_id: str, now_s: float | None = None) -> None:
        """Restart a lease (when the group leaves the producer: downstream time is what it bounds)."""
        if group_id in self.outstanding:
            self.outstanding[group_id] = time.monotonic() if now_s is None else now_s

    def expire(self, now_s: float | None = None, busy: frozenset | set = frozenset()) -> list[str]:
        """Outstanding groups whose lease ran out (lost in a dead stage's buffers) go back in line;
        `busy` ids are still being generated here and keep their lease."""
        now_s = time.monotonic() if now_s is None else now_s
        expired = [g for g, issued_s in self.outstanding.items()
                   if g not in busy and now_s - issued_s > self.lease_s]
        for group_id in expired:
            self._queue_again(group_id)
        return expired

    def release(self, busy: frozenset | set = frozenset()) -> list[str]:
        """Every outstanding group that has left the producer (not in `busy`) goes back in line now."""
        released = [g for g in self.outstanding if g not in busy]
        for group_id in released:
            self._queue_again(group_id)
        return released

    def restore(self, trained_ids: list[str], cursor: int, busy: frozenset | set = frozenset(),
                no_signal: list[str] = ()) -> None:
        """Adopt the trainer's truth: `trained_ids` are in its model, `no_signal` ones it consumed
        without training, it has nothing at or past `cursor`, and it holds none of the groups sent to
        it (`busy` ones are still generating here)."""
        self.release(busy)
        for group_id in no_signal:
            self.on_dropped_for_good(group_id, NO_SIGNAL)
        trained = set(trained_ids)
        lost = self.trained - trained                 # trained, then lost with a trainer restart
        self.trained = trained
        for group_id in lost:
            self._queue_again(group_id)
        if cursor > self.cursor:
            self.cursor = cursor
        # every id below the cursor that is neither trained nor out is a hole: issue it again
        for position in range(self.cursor):
            group_id = group_id_at(position, self.num_items)
            if group_id not in trained and group_id not in self.outstanding \
                    and group_id not in self.dropped_for_good:
                self._queue_again(group_id)
