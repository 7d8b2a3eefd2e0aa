"""Prometheus text exposition, as the servers' /metrics endpoints serve it: parse, scrape, sum."""

from __future__ import annotations

import urllib.request


def parse(text: str) -> dict[str, float]:
    """Sample key (name with its labels, as written) -> value; comments and malformed lines skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            continue
    return out


def total(samples: dict[str, float], name: str, *labels: str) -> float:
    """Sum of `name`'s samples whose labels include every one of `labels` ('k="v"')."""
    return sum(v for k, v in samples.items() if k.split("{")[0] == name and all(lb in k for lb in labels))


def fetch(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return parse(resp.read().decode())


def scrape(url: str, name: str, *labels: str) -> float:
    """Sum of a metric's samples at `url` whose labels include every one of `labels`."""
    return total(fetch(url), name, *labels)


def hit_rate(before: dict[str, float], after: dict[str, float], prefix: str = "trtserve_prefix_cache") -> dict:
    """Prefix-cache queries, hits (prompt tokens) and their ratio between two scrapes of one engine."""
    queries = total(after, f"{prefix}_queries_total") - total(before, f"{prefix}_queries_total")
    hits = total(after, f"{prefix}_hits_total") - total(before, f"{prefix}_hits_total")
    return {"queries": queries, "hits": hits, "hit_rate": round(hits / queries, 4) if queries > 0 else None}
