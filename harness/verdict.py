"""A benchmark's verdict on each of its targets: "met", or "missed by X" in the target's own unit.

Used by the bench scripts: `v = Verdict("shm vs disk, policy", measured=2.4, op=">=", target=20, unit="x")`;
print `v.line()` and keep `v.to_json()` in the result file. `Spread.of(values)` gives the mean and spread
of one figure over several seeds, so that a verdict can be taken on the mean.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

OPS = (">=", "<=")
TIGHT_UNITS = ("x", "%")  # written against the number: 20x, 2%; every other unit after a space


@dataclass(frozen=True)
class Verdict:
    """One target and what was measured against it; `measured` None = never reached or not measured."""

    name: str
    measured: float | None
    op: str              # ">=": at least `target`; "<=": at most `target`
    target: float
    unit: str = ""
    digits: int = 1      # decimals of the printed figures
    why_none: str = "not reached"  # what a missing measurement means, printed with the verdict

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, not {self.op!r}")

    @property
    def is_met(self) -> bool:
        if self.measured is None or math.isnan(self.measured):
            return False
        return self.measured >= self.target if self.op == ">=" else self.measured <= self.target

    @property
    def missed_by(self) -> float | None:
        """How far the measurement is on the wrong side of the target (0 when met, None when unknown)."""
        if self.is_met:
            return 0.0
        if self.measured is None or math.isnan(self.measured):
            return None
        return self.target - self.measured if self.op == ">=" else self.measured - self.target

    def figure(self, value: float | None) -> str:
        if value is None or math.isnan(value):
            return "-"
        sep = "" if self.unit in TIGHT_UNITS or not self.unit else " "
        return f"{value:.{self.digits}f}{sep}{self.unit}"

    @property
    def text(self) -> str:
        if self.is_met:
            return "met"
        missed = self.missed_by
        return f"missed ({self.why_none})" if missed is None else f"missed by {self.figure(missed)}"

    def line(self) -> str:
        return (f"{self.name}: {self.figure(self.measured)} "
                f"(target {self.op} {self.figure(self.target)}): {self.text}")

    def to_json(self) -> dict:
        return {"name": self.name, "measured": self.measured, "op": self.op, "target": self.target,
                "unit": self.unit, "is_met": self.is_met, "missed_by": self.missed_by, "verdict": self.text}


def print_verdicts(verdicts: list[Verdict]) -> None:
    print("\ntargets:")
    for v in verdicts:
        print(f"  {v.line()}")


@dataclass(frozen=True)
class Spread:
    """Mean, min, max and sample standard deviation of one figure over runs (e.g. seeds).

    Missing values (a run that never reached the target) are left out of the statistics and counted:
    `num_missing`; the mean is None when any is missing, since a verdict on the runs that did reach it
    would flatter the variant."""

    mean: float | None
    min: float | None
    max: float | None
    std: float | None
    num: int
    num_missing: int

    @classmethod
    def of(cls, values: list[float | None]) -> "Spread":
        present = [v for v in values if v is not None]
        num_missing = len(values) - len(present)
        if not present:
            return cls(None, None, None, None, len(values), num_missing)
        std = statistics.stdev(present) if len(present) > 1 else 0.0
        mean = statistics.fmean(present) if num_missing == 0 else None
        return cls(mean, min(present), max(present), std, len(values), num_missing)

    def text(self, fmt: str = ".1f", scale: float = 1.0) -> str:
        """`mean [min, max]`, or `- [min, max] (k of n missing)` when some runs have no value."""
        def f(v):
            return "-" if v is None else format(scale * v, fmt)
        missing = f" ({self.num_missing} of {self.num} missing)" if self.num_missing else ""
        return f"{f(self.mean)} [{f(self.min)}, {f(self.max)}]{missing}"

    def to_json(self) -> dict:
        return {"mean": self.mean, "min": self.min, "max": self.max, "std": self.std, "num": self.num,
                "num_missing": self.num_missing}
