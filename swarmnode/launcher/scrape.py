"""A daemon's Prometheus metrics page (`join --metrics-port`), read for the report's per-node figures."""

from __future__ import annotations

import math
import urllib.error
import urllib.request

SCRAPE_TIMEOUT_S = 1.0
MAX_PAGE_BYTES = 1 << 20


def read_metrics(url: str, timeout: float = SCRAPE_TIMEOUT_S) -> dict[str, float]:
    """The unlabelled samples of the page at `url` (name -> value); empty if it cannot be read in time."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            page = response.read(MAX_PAGE_BYTES).decode("utf-8", "replace")
    except (OSError, urllib.error.URLError, ValueError):
        return {}
    return parse_metrics(page)


def parse_metrics(page: str) -> dict[str, float]:
    """Unlabelled, finite samples of a Prometheus text page: `name value` lines (comments skipped)."""
    samples = {}
    for line in page.splitlines():
        parts = line.split()
        if len(parts) != 2 or line.startswith("#") or "{" in parts[0]:
            continue
        try:
            value = float(parts[1])
        except ValueError:
            continue
        if math.isfinite(value):
            samples[parts[0]] = value
    return samples
