"""The walls of the package layout, checked on the source: what may import what, and how big a module may be.

Every import counts, also one inside a function: a lazy import hides a cycle, it does not remove it.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nano_miles"
MAX_MODULE_LINES = 400
NETWORK_MODULES = ("zmq", "socket", "http", "urllib", "requests", "nano_miles.wire.sockets", "nano_miles.engine")
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


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {name: {m for m in imports_of(path, name) if m in MODULES and m != name} for name, path in MODULES.items()}


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
    for name in (m for m in MODULES if is_under(m, ("nano_miles.algo",))):
        bad = {m for m in all_imports(name) if is_under(m, NETWORK_MODULES)}
        assert not bad, f"{name} reaches network code: {bad}"
        ours = {m for m in reachable(name) if not is_under(m, ("nano_miles.algo",)) and m != "nano_miles"}
        assert not ours, f"{name} imports {ours} from outside algo/"


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


def test_every_process_is_a_thin_module_entry_point():
    """Each stage starts as `python -m nano_miles.stages.<stage>`; its __main__ imports the heavy parts
    only after the config is parsed, so `--help` and config errors come at once."""
    for stage in ("rollout", "reward", "trainer"):
        path = PACKAGE / "stages" / stage / "__main__.py"
        top_level = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert {a.name for n in top_level for a in n.names} <= {"sys"}, f"{path} imports at module level"
