"""`protocols/` stays sans-I/O: no networking, concurrency, torch, hivemind or runtime imports."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import protocols

BANNED = {"hivemind", "asyncio", "socket", "subprocess", "threading", "torch", "swarmnode"}
ROOT = Path(protocols.__file__).parent
MODULES = sorted(ROOT.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
            "__import__",
            "import_module",
        ):
            roots.update(
                arg.value.split(".")[0]
                for arg in node.args[:1]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            )
    return roots


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_source_imports_nothing_banned(path: Path) -> None:
    assert not imported_roots(path) & BANNED


def test_the_checker_sees_every_form_of_import(tmp_path: Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text(
        "import torch.nn\nfrom asyncio import run\nimportlib.import_module('socket')\n"
        "__import__('threading')\nfrom . import sibling\n"
    )
    assert imported_roots(source) == {"torch", "asyncio", "socket", "threading"}


def test_importing_protocols_loads_nothing_banned() -> None:
    names = [module_name(path) for path in MODULES]
    script = (
        "import importlib, json, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT.parent,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    loaded = {name.split(".")[0] for name in json.loads(result.stdout)}
    assert not loaded & BANNED
    assert set(names) <= set(json.loads(result.stdout))
