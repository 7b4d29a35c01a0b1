"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from swarm_harness import LocalTestSwarm, local_test_swarm


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalTestSwarm]:
    """A local test swarm of a fresh run (`swarm_harness.local_test_swarm`); test files that check more
    on exit define their own."""
    with local_test_swarm(tmp_path / "swarm") as harness:
        yield harness
