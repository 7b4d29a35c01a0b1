"""The runtime's imports point one way: no module of `swarmnode/` or `protocols/` imports itself back through
others (issue 10: the node's recovery once imported the daemon that imported it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("swarmnode", "protocols")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a `from a import b` counts `a.b` when that is a module)."""
    imported: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            names = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names.add(node.module)
                    names.update(f"{node.module}.{alias.name}" for alias in node.names)
                elif isinstance(node, ast.Import):
                    names.update(alias.name for alias in node.names)
            imported[module_name(path)] = names
    return {
        module: {name for name in names if name in imported and name != module}
        for module, names in imported.items()
    }


def cycle_from(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, if there is one."""
    stack, seen = [(start, [start])], {start}
    while stack:
        module, path = stack.pop()
        for target in sorted(graph[module]):
            if target == start:
                return [*path, start]
            if target not in seen:
                seen.add(target)
                stack.append((target, [*path, target]))
    return None


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 40  # the whole runtime was read
    cycles = [cycle for module in sorted(graph) if (cycle := cycle_from(graph, module)) is not None]
    assert not cycles, " -> ".join(cycles[0])


def test_a_cycle_is_found() -> None:
    assert cycle_from({"a": {"b"}, "b": {"c"}, "c": {"a"}}, "a") == ["a", "b", "c", "a"]
    assert cycle_from({"a": {"b"}, "b": set()}, "a") is None
