"""Word problems in the GSM8K layout, made from the arithmetic task's expressions: the project's own data.
Run: python -m nano_miles.tasks.word_problems --out examples/word_problems [--num-train N] [--num-test N]

Each two-step expression whose steps stay non-negative becomes a short story, e.g. `(7 * 4) + 12`:

    question: Sam has 7 bags with 4 marbles in each bag. Then Sam finds 12 more marbles.
              How many marbles does Sam have now?
    answer:   7*4=28, 28+12=40
              #### 40

The records carry GSM8K's keys (`question`, `answer`; the answer is a worked solution ending in
`#### N`), so a file written here trains exactly as a user's GSM8K-style file does:
`--task.name=nano_miles.tasks.files --task.prompt_key=question --task.label_key=answer`. The split
follows the arithmetic task's (a stable hash of the expression), so no test story shares its
numbers and operations with a train story. Names and objects are picked by a hash of the expression:
the same expression always tells the same story.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import random
from pathlib import Path

from nano_miles.run.cli import ArgumentParser, UserError, run
from nano_miles.tasks.arithmetic import Expression, all_expressions, split_of

NAMES = ("Sam", "Ana", "Ravi", "Mia", "Tom", "Lena", "Omar", "Yuki", "Ben", "Zoe")
# (objects, their container, containers)
THINGS = (("marbles", "bag", "bags"), ("apples", "basket", "baskets"), ("stamps", "album", "albums"),
          ("pencils", "box", "boxes"), ("shells", "jar", "jars"), ("cards", "pack", "packs"),
          ("beads", "pouch", "pouches"), ("cookies", "tray", "trays"))
# How the first step builds a count; {s} is the subject ("Sam", or "each child").
INNER = {"+": "{S} has {a} {things} and gets {b} more.",
         "-": "{S} has {a} {things} and gives away {b} of them.",
         "*": "{S} has {a} {boxes} with {b} {things} in each {box}."}


def is_told_as_story(e: Expression) -> bool:
    """Stories count things, so every step must stay non-negative."""
    inner = e.inner_value()
    return inner >= 0 and e.value() >= 0


def story(e: Expression) -> str:
    """The question text for `e` (see the module doc)."""
    digest = hashlib.blake2b(e.text().encode(), digest_size=8).digest()
    name = NAMES[digest[0] % len(NAMES)]
    things, box, boxes = THINGS[digest[1] % len(THINGS)]
    words = dict(a=e.a, b=e.b, c=e.c, things=things, box=box, boxes=boxes)
    if e.is_left:  # (a op b) op c: one person, a second step on the count
        first = INNER[e.op_inner].format(S=name, **words)
        second = {"+": f"Then {name} finds {e.c} more {things}. How many {things} does {name} have now?",
                  "-": f"Then {name} loses {e.c} of them. How many {things} does {name} have now?",
                  "*": f"Each of the {things} costs {e.c} dollars. How many dollars are they worth in all?"}
        return f"{first} {second[e.op_outer]}"
    # c op (a op b): a second count, or a number of people, around the first
    first = INNER[e.op_inner].format(S="Each child" if e.op_outer == "*" else name, **words)
    if e.op_outer == "*":
        return f"There are {e.c} children. {first} How many {things} do the children have in all?"
    other = NAMES[(digest[0] + 1) % len(NAMES)]
    if e.op_outer == "+":
        return f"{other} has {e.c} {things}. {first} How many {things} do {other} and {name} have together?"
    return f"{other} has {e.c} {things}. {first} How many more {things} does {other} have than {name}?"


def solution(e: Expression) -> str:
    """The worked solution in GSM8K's layout: the arithmetic task's two steps, then `#### N`."""
    steps = e.worked_response().split(" <answer>")[0]
    return f"{steps}\n#### {e.value()}"


@functools.lru_cache(maxsize=2)
def story_expressions(split: str) -> tuple[Expression, ...]:
    return tuple(e for e in all_expressions() if is_told_as_story(e) and split_of(e.text()) == split)


def make_records(split: str, num: int, seed: int = 0) -> list[dict[str, str]]:
    """`num` distinct records of `split` in a seeded order: {"question": ..., "answer": ...}."""
    pool = list(story_expressions(split))
    if not 0 <= num <= len(pool):
        raise UserError(f"the {split} split holds {len(pool)} word problems, not {num}")
    random.Random(seed).shuffle(pool)
    return [{"question": story(e), "answer": solution(e)} for e in pool[:num]]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m nano_miles.tasks.word_problems", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for train.jsonl and test.jsonl")
    parser.add_argument("--num-train", type=int, default=2000, help="train records (default 2000)")
    parser.add_argument("--num-test", type=int, default=200, help="test records (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="which records, in which order")
    args = parser.parse_args(argv)
    splits = {split: make_records(split, num, args.seed)  # both made before anything is written
              for split, num in (("train", args.num_train), ("test", args.num_test))}
    for split, records in splits.items():
        path = args.out / f"{split}.jsonl"
        write_jsonl(path, records)
        print(f"wrote {len(records)} {split} records to {path}")
    return 0


if __name__ == "__main__":
    run(main, "word_problems")
