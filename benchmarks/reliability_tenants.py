"""Tenants in the reliability burst: who sends how many streams, the gateway's tenants file, and fairness.

`--tenants heavy:4000:2000,light-a:500,light-b:500` (name:streams[:max_queued]): each tenant's streams are sent
at once, in the order listed (the first tenant's flood reaches the gateway before the others' requests), each
with its own API key; a third field bounds how many of that tenant's requests may wait (past it: 429 with
Retry-After). `--no-tenant-keys` sends the same traffic without keys to an open gateway: the baseline, where
requests queue by the OpenAI `user` field they carry, whichever tenant they belong to.

Fairness while every tenant still has work waiting: from the start until the first tenant's last answer,
each tenant's completions per second, summarised by Jain's index (1: equal rates; 1/n: one tenant served).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.metrics import percentiles
from benchmarks.reliability_client import COMPLETED, REFUSED, Result


@dataclass(frozen=True)
class TenantLoad:
    name: str
    streams: int
    max_queued: int | None = None  # its requests waiting for a gateway slot (None: only the global bound)

    @property
    def api_key(self) -> str:
        return f"sk-reliability-{self.name}"


def parse(spec: str) -> tuple[TenantLoad, ...]:
    """`name:streams[:max_queued],...`; ValueError naming the part that is wrong."""
    tenants = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        fields = part.split(":")
        if len(fields) not in (2, 3) or not fields[0]:
            raise ValueError(f"{part!r}: expected name:streams[:max_queued]")
        try:
            numbers = [int(f) for f in fields[1:]]
        except ValueError:
            raise ValueError(f"{part!r}: streams and max_queued are whole numbers") from None
        if numbers[0] < 1 or (len(numbers) == 2 and numbers[1] < 0):
            raise ValueError(f"{part!r}: streams must be >= 1 and max_queued >= 0")
        tenants.append(TenantLoad(fields[0], *numbers))
    if len({t.name for t in tenants}) != len(tenants):
        raise ValueError(f"{spec!r}: a tenant is named twice")
    return tuple(tenants)


def write_tenants_file(tenants: Sequence[TenantLoad], path: Path) -> Path:
    """The gateway's `--tenants` file (runtime.gateway.tenants) for these tenants."""
    section: dict[str, dict] = {}
    for t in tenants:
        section[t.name] = {"key": t.api_key} | ({"max_queued": t.max_queued} if t.max_queued is not None else {})
    path.write_text(yaml.safe_dump({"tenants": section}, sort_keys=False))
    return path


def jain(rates: Sequence[float]) -> float | None:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2)."""
    squares = sum(x * x for x in rates)
    return sum(rates) ** 2 / (len(rates) * squares) if squares else None


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max (empty without values)."""
    if not values:
        return {}
    return {"p50": round(statistics.median(values), 3), "min": min(values), "max": max(values)}


def tenant_summary(results: Sequence[Result], tenants: Sequence[TenantLoad]) -> dict:
    """Per tenant: outcomes, Retry-After on its 429s, TTFT; and the completion rates while all were backlogged."""
    mine = {t.name: [r for r in results if r.tenant == t.name] for t in tenants}
    last = {name: max((r.end for r in rs if r.outcome == COMPLETED), default=None) for name, rs in mine.items()}
    window = min((t for t in last.values() if t is not None), default=None)
    rows = {}
    for t in tenants:
        rs = mine[t.name]
        refused = [r for r in rs if r.outcome == REFUSED]
        waits = [r.retry_after_s for r in refused if r.retry_after_s is not None]
        early = sum(r.outcome == COMPLETED and r.end <= window for r in rs) if window else 0
        rows[t.name] = {
            "streams": len(rs),
            "max_queued": t.max_queued,
            "completed": sum(r.outcome == COMPLETED for r in rs),
            "refused": len(refused),
            "refused_429": sum(r.status == 429 for r in refused),
            "retry_after_given": len(waits),
            "retry_after_s": spread(waits),
            "ttft_ms": percentiles([r.first_delta - r.start for r in rs if r.first_delta is not None]),
            "last_completion_s": round(last[t.name], 1) if last[t.name] is not None else None,
            "completed_per_s_while_all_waited": round(early / window, 2) if window else None,
        }
    rates = [row["completed_per_s_while_all_waited"] or 0.0 for row in rows.values()]
    return {"tenants": rows, "window_s": round(window, 1) if window else None, "jain": jain(rates)}


def render(section: dict, keyed: bool) -> list[str]:
    how = (
        "each tenant with its own API key (the fairness key is the tenant)"
        if keyed
        else "no API keys: an open gateway, requests queued by the OpenAI `user` field they carry"
    )
    jain_text = f"{section['jain']:.3f}" if section["jain"] is not None else "-"
    out = [
        "## Tenants",
        "",
        f"Sent in the order listed, {how}. While all tenants still had requests waiting (the first "
        f"{section['window_s']} s, until the first tenant's last answer): Jain's fairness index over their completion "
        f"rates {jain_text} (1: equal; 1/{len(section['tenants'])}: one tenant served).",
        "",
        "| tenant | streams | max_queued | completed | refused (429) | Retry-After given | Retry-After p50 s "
        "(min-max) | TTFT p50 / p99 ms | last answer s | completed/s while all waited |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in section["tenants"].items():
        wait, ttft = row["retry_after_s"], row["ttft_ms"]
        wait_text = f"{wait['p50']:.1f} ({wait['min']:.1f}-{wait['max']:.1f})" if wait.get("p50") is not None else "-"
        ttft_text = f"{ttft['p50']:.0f} / {ttft['p99']:.0f}" if ttft.get("p50") is not None else "-"
        bound = row["max_queued"] if keyed and row["max_queued"] is not None else "-"
        out.append(
            f"| {name} | {row['streams']} | {bound} | "
            f"{row['completed']} | {row['refused']} ({row['refused_429']}) | {row['retry_after_given']} | "
            f"{wait_text} | {ttft_text} | {row['last_completion_s']} | "
            f"{row['completed_per_s_while_all_waited']} |"
        )
    return [*out, ""]
