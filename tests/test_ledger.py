"""The producer's ledger: leases, drops, rollbacks and restarts never lose or double-train a group."""

from nano_miles.stages.rollout.ledger import Ledger
from nano_miles.wire.codec import position_of


def issue(ledger, n, now_s=0.0):
    return [ledger.next_group(now_s)[0] for _ in range(n)]


def test_fresh_items_in_dataset_order_across_epochs():
    ledger = Ledger(num_items=3, lease_s=10)
    assert issue(ledger, 4) == ["e0-i0", "e0-i1", "e0-i2", "e1-i0"]
    assert ledger.next_group(0.0) == ("e1-i1", 1, 0)


def test_expired_lease_reissues_with_next_attempt_first():
    ledger = Ledger(num_items=100, lease_s=10)
    issue(ledger, 3, now_s=0.0)
    ledger.on_trained(["e0-i1"])
    assert ledger.expire(now_s=5.0) == []
    assert sorted(ledger.expire(now_s=11.0)) == ["e0-i0", "e0-i2"]
    assert ledger.next_group(12.0) == ("e0-i0", 0, 1)
    assert ledger.next_group(12.0) == ("e0-i2", 2, 1)
    assert ledger.next_group(12.0) == ("e0-i3", 3, 0)


def test_dropped_groups_come_back_trained_ones_never():
    ledger = Ledger(num_items=100, lease_s=10)
    issue(ledger, 2)
    ledger.on_trained(["e0-i0"])
    ledger.on_dropped(["e0-i1", "e0-i0"])  # a stale copy of an already trained group is ignored
    assert ledger.next_group(1.0)[0] == "e0-i1"
    assert ledger.next_group(1.0)[0] == "e0-i2"


def test_trainer_rollback_reissues_what_it_lost():
    ledger = Ledger(num_items=100, lease_s=10)
    issue(ledger, 6)
    ledger.on_trained(["e0-i0", "e0-i1", "e0-i2", "e0-i3"])
    # the trainer restarted from a checkpoint holding only the first two groups
    ledger.restore(["e0-i0", "e0-i1"], cursor=4)
    again = [ledger.next_group(1.0)[0] for _ in range(2)]
    assert sorted(again) == ["e0-i2", "e0-i3"]
    assert ledger.next_group(1.0)[0] == "e0-i6"  # e0-i4, e0-i5 are still out on their leases
    assert ledger.budget_used() == 2 + 5


def test_restarted_producer_rebuilds_from_the_trainer():
    ledger = Ledger(num_items=100, lease_s=10)  # a fresh process: knows nothing
    ledger.restore(["e0-i0", "e0-i2", "e0-i3"], cursor=5)
    got = [ledger.next_group(0.0)[0] for _ in range(3)]
    assert got == ["e0-i1", "e0-i4", "e0-i5"]  # the hole first, then onward from the cursor
    assert ledger.budget_used() == 3 + 3


def test_every_prompt_once_under_random_failures():
    import random
    rng = random.Random(0)
    ledger = Ledger(num_items=50, lease_s=5)
    trained_at: dict[str, int] = {}
    now = 0.0
    while len(trained_at) < 120:
        now += 1.0
        for _ in range(3):
            gid = ledger.next_group(now)[0]
            fate = rng.random()
            if fate < 0.6 and gid not in trained_at:
                trained_at[gid] = int(now)
                ledger.on_trained([gid])
            elif fate < 0.8:
                ledger.on_dropped([gid])
            # else: lost in a buffer; the lease brings it back
        ledger.expire(now)
    positions = sorted(position_of(g, ledger.num_items) for g in trained_at)
    assert positions[:100] == list(range(100))  # no prompt skipped below the frontier
