"""The walls of the package layout, checked on the source: what may import what, and how big a module may be.

Every import counts, also one inside a function: a lazy import hides a cycle, it does not remove it.
"""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nano_miles"
MAX_MODULE_LINES = 400
# all that the pure math may import: tensors and the standard library's plain data helpers
ALGO_MAY_IMPORT = ("torch", "numpy", "math", "dataclasses", "functools", "typing", "__future__", "nano_miles.algo")
ALGO_MAY_NOT_IMPORT = ("torch.distributed", "torch.multiprocessing", "torch.utils.data")
PROCS = sorted((ROOT / "procs").glob("*.py"))  # one thin entry point per process supervisord starts
MAX_PROC_LINES = 80
ENTRY_POINTS = [*PROCS, PACKAGE / "local_engine" / "__main__.py", PACKAGE / "policy" / "__main__.py"]
CLI = "nano_miles.run.cli"  # UserError and `run`: what turns a user's mistake into one line
# the engine side of each weight transport, and everything the engine process runs
ENGINE_SIDE = ("nano_miles.local_engine", "nano_miles.weights.tensor_receiver", "nano_miles.weights.flat_receiver",
               "nano_miles.weights.broadcast_group", "nano_miles.weights.named_tensors")
TRAINER_SIDE = ("nano_miles.stages", "nano_miles.weights.tensor_sender", "nano_miles.weights.flat_sender",
                "nano_miles.weights.broadcast_sender")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str) -> set[str]:
    """Every module `path` imports, anywhere in the file, as absolute dotted names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = name.split(".")[: -node.level + (path.name == "__init__.py") or None]
                base = ".".join(package + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def with_parents(module: str) -> set[str]:
    """Importing a.b.c runs a/__init__ and a/b/__init__ first: each is an import too."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {name: {m for imported in imports_of(path, name) for m in with_parents(imported)
                if m in MODULES and m != name and not name.startswith(m + ".")}  # not its own packages
         for name, path in MODULES.items()}


def reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in GRAPH[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def all_imports(start: str) -> set[str]:
    """Every module, ours or not, that importing `start` can import (through our modules)."""
    return {m for name in reachable(start) | {start} for m in imports_of(MODULES[name], name)}


def is_under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep] if dep in path else [node, dep]
            if dep not in state:
                cycle = visit(dep, path + [dep])
                if cycle:
                    return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [node])
            if cycle:
                return cycle
    return None


def subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_library_imports_neither_harness_nor_tests():
    for name, path in MODULES.items():
        bad = {m for m in imports_of(path, name) if is_under(m, ("harness", "tests", "procs", "conftest"))}
        assert not bad, f"{name} imports {bad}"


def test_no_import_cycle_between_modules():
    assert find_cycle(GRAPH) is None, f"import cycle: {' -> '.join(find_cycle(GRAPH))}"


def test_no_import_cycle_between_subpackages():
    packages: dict[str, set[str]] = {}
    for name, deps in GRAPH.items():
        packages.setdefault(subpackage(name), set()).update(
            subpackage(d) for d in deps if subpackage(d) != subpackage(name))
    assert find_cycle(packages) is None, f"sub-package cycle: {' -> '.join(find_cycle(packages))}"


def test_algo_is_pure_math():
    """No sockets, no HTTP, no processes: tensors in, tensors out."""
    for name in (m for m in MODULES if is_under(m, ("nano_miles.algo",))):
        imported = all_imports(name)
        bad = {m for m in imported if not is_under(m, ALGO_MAY_IMPORT) or is_under(m, ALGO_MAY_NOT_IMPORT)}
        assert not bad, f"{name} imports {bad}"


def test_no_stage_imports_another_stage():
    """Stages talk over sockets only; what two share lives outside stages/."""
    stages = ("rollout", "reward", "trainer")
    for stage in stages:
        own = f"nano_miles.stages.{stage}"
        others = tuple(f"nano_miles.stages.{s}" for s in stages if s != stage)
        for name in (m for m in MODULES if is_under(m, (own,))):
            bad = {m for m in reachable(name) if is_under(m, others)}
            assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize("name", ["nano_miles.wire.codec", "nano_miles.wire.data", "nano_miles.wire.control"])
def test_wire_messages_need_no_torch(name):
    bad = {m for m in all_imports(name) if is_under(m, ("torch", "transformers"))}
    assert not bad, f"{name} needs {bad}"


def test_config_and_control_messages_need_no_numpy():
    for name in ("nano_miles.run.config", "nano_miles.wire.control", "nano_miles.wire.codec"):
        bad = {m for m in all_imports(name) if is_under(m, ("numpy", "torch"))}
        assert not bad, f"{name} (read by every entry point before --help) needs {bad}"


def test_engine_side_never_imports_trainer_code():
    for name in (m for m in MODULES if is_under(m, ENGINE_SIDE)):
        bad = {m for m in reachable(name) if is_under(m, TRAINER_SIDE)}
        assert not bad, f"{name} (engine side) imports trainer code {bad}"


def test_no_module_over_the_line_budget():
    sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert max(sizes.values()) <= MAX_MODULE_LINES, {n: s for n, s in sizes.items() if s > MAX_MODULE_LINES}


def module_level_imports(path: Path) -> set[str]:
    """Imports that run when the file is imported: everywhere but inside function bodies."""
    found, todo = set(), list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module or "")
        todo.extend(ast.iter_child_nodes(node))
    return found


def test_procs_holds_one_file_per_supervisord_program():
    """The tree shows the processes: every program supervisord.conf starts is a file of procs/."""
    import re
    commands = re.findall(r"^command=python %\(here\)s/procs/(\w+)\.py", (ROOT / "supervisord.conf").read_text(), re.M)
    assert sorted(set(commands)) == sorted(p.stem for p in PROCS) == ["engine", "reward", "rollout", "run_end",
                                                                      "trainer"]


@pytest.mark.parametrize("path", PROCS, ids=lambda p: p.name)
def test_every_proc_is_thin_and_finds_the_library_installed(path):
    """A procs/ file parses the config, builds the stage and runs it: small, and no `sys.path` edit
    (the installed package is found from any working directory supervisord gives it)."""
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_PROC_LINES, f"{path.name}: {len(text.splitlines())} lines"
    assert "sys.path" not in text, f"{path.name} edits sys.path"


@pytest.mark.parametrize("path", ENTRY_POINTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_process_imports_nothing_heavy_before_its_config(path):
    """An entry point imports only the standard library and the user-error path (itself standard
    library only) before `main` runs, and the heavy parts after the config is parsed: `--help` answers
    at once."""
    top = {m for m in module_level_imports(path) if m != CLI}
    top = {m.split(".")[0] for m in top}
    assert top <= set(sys.stdlib_module_names), f"{path.name} imports {top - set(sys.stdlib_module_names)} at import"


def test_the_user_error_path_needs_only_the_standard_library():
    top = {m.split(".")[0] for m in all_imports(CLI)}
    assert top <= set(sys.stdlib_module_names), f"{CLI} imports {top - set(sys.stdlib_module_names)}"
