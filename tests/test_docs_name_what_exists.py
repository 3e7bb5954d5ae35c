"""Docs that name the code: every repository path, module and `module.function` / `Class.method` written in
backticks in README.md, docs/, bench/results/*/README.md and the docstrings of the code exists.

Run: `pytest tests/test_docs_name_what_exists.py`. Read from the source (AST and files), nothing imported.
What a span is taken for, in this order:
  * a path (`nano_miles/algo/loss.py`, `procs/`, `bench/results/learning.json`): it must exist, from the
    repository's root, the package's, or (in a docstring) the module's own folder. Paths the program
    writes at run time (`runs/...`, `checkpoints/step_N/`) and placeholders (`<stage>`, `*`) are not files;
  * a dotted name of ours (`nano_miles.weights.flat_receiver.load_flat`, `nano_miles.tasks.arithmetic:reward`):
    the module exists and defines the name;
  * `Class.method` (`Learner.step`): some class of that name defines it;
  * `section.key` of the config (`trainer.micro_batch_tokens`): the section has that field;
  * `module.name` of one of our module files (`launch.engine_env`): that module defines it;
  * a bare snake_case name (`load_newest`): it occurs in the code (not only in prose).
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nano_miles"
CODE_DIRS = ("nano_miles", "procs", "harness", "bench", "tests")
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("bench/results/*/README.md")),
            *sorted(PACKAGE.glob("assets/*/README.md"))]
SPAN = re.compile(r"`([^`\n]+)`")
# what the program or the user makes at run time, not files of the repository
RUN_TIME = ("runs/", "checkpoints/", "heartbeat/", "models/", "data/", "tensorboard/", "step_", "/tmp", "/dev/",
            "~", "$", "..", "tmp_path", "/usr", "/opt", "/etc", "shared/", "step<N>")
FILE_SUFFIXES = (".py", ".md", ".toml", ".json", ".jsonl", ".png", ".conf", ".sh", ".jinja", ".safetensors", ".txt",
                 ".log")
SOURCE_SUFFIXES = (".py", ".md")  # a bare file name of these is a file of ours; of the others, often a run's output
# a reference to another project's API: its own names (SGLang's functions, arguments) are not ours to find
FOREIGN = ("docs/sglang-contract.md",)


def code_files() -> list[Path]:
    return sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py") if ".venv" not in p.parts)


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


@cache
def defined_names(path: Path) -> frozenset[str]:
    """Top-level names a module defines or imports (functions, classes, assignments)."""
    names = set()
    for node in parsed(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


@cache
def class_members() -> dict[str, set[str]]:
    """Class name -> every name defined in its body (methods, fields, properties), over all our code."""
    members: dict[str, set[str]] = {}
    for path in code_files():
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.ClassDef):
                own = members.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        own.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        own.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        own.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return members


@cache
def code_words() -> frozenset[str]:
    """Every identifier and every word inside a string literal of the code, docstrings and comments left out."""
    words = set()
    for path in code_files():
        docstrings = {id(n.body[0].value) for n in ast.walk(parsed(path))
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        doc_lines = {(n.lineno, n.end_lineno) for n in ast.walk(parsed(path)) if id(n) in docstrings}
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type == tokenize.NAME:
                words.add(tok.string)
            elif tok.type == tokenize.STRING and (tok.start[0], tok.end[0]) not in doc_lines:
                words.update(re.findall(r"\w+", tok.string))
    for path in (ROOT / "configs").glob("*.toml"):
        words.update(re.findall(r"\w+", path.read_text()))
    return frozenset(words)


def module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@cache
def config_sections() -> dict[str, set[str]]:
    """[section] -> its keys, read from the dataclasses of nano_miles/run/sections.py."""
    sections = {}
    for node in parsed(PACKAGE / "run" / "sections.py").body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Config") and node.name != "Config":
            sections[node.name.removesuffix("Config").lower()] = {
                item.target.id for item in node.body if isinstance(item, ast.AnnAssign)}
    return sections


@cache
def module_stems() -> dict[str, list[Path]]:
    stems: dict[str, list[Path]] = {}
    for path in code_files():
        stems.setdefault(path.stem, []).append(path)
    return stems


@cache
def repository_file_names() -> frozenset[str]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return frozenset(name for path in listed for name in Path(path).parts)


def check_path(span: str, folder: Path) -> str | None:
    path = span.split("::")[0].rstrip("/").split(":")[0]
    for base in (folder, ROOT, PACKAGE):
        if (base / path).exists():
            return None
    return f"no file or folder {path!r}"


def check_dotted(span: str) -> str | None:
    """A module (nano_miles.a.b), a name in one (nano_miles.a.b.name, nano_miles.a.b:name)."""
    module, _, attr = span.partition(":")
    if module_file(module):
        return None if not attr or attr in defined_names(module_file(module)) else f"{module} defines no {attr!r}"
    head, _, last = module.rpartition(".")
    if attr or not module_file(head):
        return f"no module {module!r}"
    if last in defined_names(module_file(head)):
        return None
    return f"{head} defines no {last!r}"


def problem(span: str, folder: Path, is_foreign: bool = False) -> str | None:
    """Why `span` names nothing that exists, or None (it exists, or it is not a name of ours)."""
    span = span.strip()
    words = span.split()
    if len(words) > 1:  # a command: checked only for the script of ours it runs (`python procs/trainer.py ...`)
        span = words[1] if words[0] == "python" and words[1].endswith(".py") else ""
    if not span or re.search(r"[\s<>*{}()\[\]=,'\"|@#]|\.\.\.", span) or span.startswith(RUN_TIME):
        return None
    if "://" in span or span.startswith((".", "/")) or not re.search(r"[A-Za-z]", span):
        return None
    if span.endswith(FILE_SUFFIXES) and "/" not in span:  # a bare file name
        if not span.endswith(SOURCE_SUFFIXES):
            return None
        if folder == ROOT:  # in the docs: somewhere in the repository
            return None if span in repository_file_names() else f"no file {span!r} anywhere"
        return check_path(span, folder)  # in a docstring: the module's neighbour
    if "/" in span:
        first = span.split("/")[0]
        is_path = span.endswith((*FILE_SUFFIXES, "/")) or any((b / first).exists() for b in (folder, ROOT, PACKAGE))
        return check_path(span, folder) if is_path else None  # else a metric or part name (`math/accuracy`)
    if not re.fullmatch(r"[A-Za-z_][\w.:]*", span):
        return None
    if span.split(".")[0] in ("nano_miles", "harness", "bench", "procs", "tests"):
        return check_dotted(span)
    parts = span.split(".")
    if len(parts) == 2:
        head, name = parts
        if head in class_members():
            return None if name in class_members()[head] else f"class {head} has no {name!r}"
        if head in config_sections():
            return None if name in config_sections()[head] else f"[{head}] has no key {name!r}"
        if head in module_stems():
            found = any(name in defined_names(p) for p in module_stems()[head])
            return None if found else f"module {head}.py defines no {name!r}"
        return None
    if len(parts) == 1 and "_" in span and span.islower() and ":" not in span and not is_foreign:
        return None if span in code_words() else f"{span!r} occurs nowhere in the code"
    return None


def docstrings() -> list[tuple[str, str, Path]]:
    """(where, text, the module's folder) for every module, class and function docstring of our code."""
    found = []
    for path in code_files():
        for node in ast.walk(parsed(path)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node, clean=False)
                if text:
                    where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}"
                    found.append((where, text, path.parent))
    return found


def sources() -> list[tuple[str, str, Path]]:
    return [(str(p.relative_to(ROOT)), p.read_text(), ROOT) for p in MARKDOWN] + docstrings()


def spans(text: str) -> list[str]:
    # fenced code blocks are commands and output, not names in prose
    return SPAN.findall(re.sub(r"```.*?```", "", text, flags=re.S))


SOURCES = sources()


@pytest.mark.parametrize("where, text, folder", SOURCES, ids=[where for where, _, _ in SOURCES])
def test_every_name_in_backticks_exists(where, text, folder):
    missing = {s: why for s in spans(text) if (why := problem(s, folder, where in FOREIGN))}
    assert not missing, f"{where} names what does not exist: {missing}"
