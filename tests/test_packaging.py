"""What pyproject.toml promises: the dependencies the library imports, and the Python it runs on."""

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DISTRIBUTION = {"zmq": "pyzmq"}  # import names that differ from their distribution's name
# imported only where an option asks for them, each declared in an extra
OPTIONAL = {"sglang": "gpu",  # the engine and weight transports on a GPU
            "wandb": "test",  # metrics.wandb_project, off by default
            "datasets": "data"}  # task data as Parquet or a datasets directory


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def third_party_imports() -> set[str]:
    found = set()
    for path in [*(ROOT / "nano_miles").rglob("*.py"), *(ROOT / "procs").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m != "nano_miles"}


def test_every_library_import_is_a_dependency():
    """A fresh `make setup` has all the library needs: plots too (matplotlib), not only with an extra."""
    declared = requirement_names(PROJECT["dependencies"])
    for module in sorted(third_party_imports()):
        name = DISTRIBUTION.get(module, module).lower().replace("_", "-")
        if module in OPTIONAL:
            assert name in requirement_names(PROJECT["optional-dependencies"][OPTIONAL[module]]), module
        else:
            assert name in declared, f"the library imports {module}, which pyproject's dependencies lack"


def minimum_python() -> tuple[int, int]:
    major, minor = re.fullmatch(r">=\s*(\d+)\.(\d+)", PROJECT["requires-python"].strip()).groups()
    return int(major), int(minor)


def test_every_module_parses_as_the_minimum_python():
    """requires-python is a promise: newer syntax (a 3.12 `type X = ...`, type parameter lists) fails here."""
    version = minimum_python()
    paths = [p for folder in ("nano_miles", "procs", "harness", "tests", "bench") for p in (ROOT / folder).rglob("*.py")]
    for path in paths:
        ast.parse(path.read_text(), filename=str(path), feature_version=version)


def test_readme_states_the_minimum_python():
    major, minor = minimum_python()
    assert f"Python ≥ {major}.{minor}" in (ROOT / "README.md").read_text()
