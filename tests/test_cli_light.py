"""`swarmnode --help` and every command's `--help` answer without importing torch, hivemind or numpy (they
load only when a command runs), so help comes in well under a second on a small machine."""

from __future__ import annotations

import json
import subprocess
import sys

# hivemind's package itself is registered, empty, by the CLI (`hivemind_parts`); any real part loads its utils
HEAVY = ("torch", "hivemind.utils", "numpy", "pyarrow", "matplotlib", "tokenizers")

PROBE = """
import json, sys
from swarmnode.cli import main
loaded = {}
for command in [None, *sorted(main.commands)]:
    try:
        main([command, "--help"] if command else ["--help"])
    except SystemExit:
        pass
    loaded[command or ""] = [name for name in HEAVY if name in sys.modules]
print(json.dumps(loaded))
"""


def test_help_imports_none_of_the_heavy_libraries() -> None:
    done = subprocess.run(
        [sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{PROBE}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(loaded) >= {"", "up", "train", "join", "bootstrap", "status", "export", "schedule"}
    assert all(heavy == [] for heavy in loaded.values()), loaded
