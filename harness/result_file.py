"""A bench's JSON result, rewritten whole after every finished run, so a bench cut short keeps what it did.

Used by the bench scripts: `write_result(path, {"rows": rows}, is_complete=False)` after each run, and
`write_result(path, result, is_complete=True)` once the aggregates and verdicts are in. The file
always parses, and its `complete` field says whether the bench got to its end.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_result(path: Path, result: dict, *, is_complete: bool) -> None:
    """Replace `path` with `result` and `"complete": is_complete`, all at once: a reader (or a bench
    killed mid-write) sees the previous file or this one, never half of one."""
    if "complete" in result:
        raise ValueError("the result has a 'complete' field of its own; write_result sets it")
    text = json.dumps({"complete": is_complete, **result}, indent=2) + "\n"  # fails before the file is touched
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
