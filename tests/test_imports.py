"""The runtime's imports point one way: no module of `swarmnode/` or `protocols/` imports itself back through
others (issue 10: the node's recovery once imported the daemon that imported it)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
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


def python_prints(script: str) -> str:
    """What a fresh interpreter running `script` in the repository prints (it must succeed)."""
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_hivemind_is_imported_by_its_parts_only() -> None:
    """`hivemind_parts.register_package` leaves the package without its top-level names: every import of
    hivemind names a submodule."""
    whole = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
                names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                if "hivemind" in names:
                    whole.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not whole, whole


def test_a_daemon_loads_hivemind_without_its_averager_and_scipy() -> None:
    script = (
        "import sys\n"
        "from swarmnode.hivemind_parts import register_package\n"
        "register_package()\n"
        "import swarmnode.dht, swarmnode.node.run, swarmnode.status\n"
        "whole = ('hivemind.averaging', 'hivemind.moe', 'hivemind.optim', 'scipy')\n"
        "print(sorted(m for m in whole if m in sys.modules))\n"
    )
    assert python_prints(script) == "[]"


def test_building_and_training_a_stage_imports_neither_dynamo_nor_sympy() -> None:
    """torch.optim imports torch._dynamo, and `Module.to_empty` and a backward pass given a gradient import
    sympy, on first use (0.5-1.2 s each of a starting daemon): a piece's build, forward, backward (a stage's
    with the next stage's gradient) and optimizer step need neither."""
    script = textwrap.dedent(
        """
        import sys
        import torch
        from swarmnode.node.gradient_sums import IndexOrderedSum, OrderFreeSum
        from swarmnode.optim import Schedule, StageOptimizer
        from swarmnode.pieces import build_piece
        from swarmnode.presets import get_preset

        config = get_preset("tiny").model
        for stage in (0, 1):
            piece = build_piece(config, stage, 3, 0)
            optimizer = StageOptimizer(piece, Schedule(1e-3, 10, 100))
            if stage == 0:
                gradients = OrderFreeSum(list(piece.parameters()))
                tokens = torch.randint(0, config.vocab_size, (2, 16))
                gradients.backward(piece.loss(piece.embed(tokens), tokens))
            else:
                gradients = IndexOrderedSum(list(piece.parameters()))
                outputs = piece(torch.randn(2, 16, config.dim))
                gradients.backward(0, outputs, torch.randn(outputs.shape))
            gradients.load()
            optimizer.step()
        print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
        """
    )
    assert python_prints(script) == "[]"
