"""The reliability burst's tenants: the spec, the gateway's tenants file, the planned order, and the per-tenant
report (outcomes, Retry-After, fairness while all tenants had work waiting) against hand-computed values."""

from __future__ import annotations

import pytest

from benchmarks.reliability import burst_jobs
from benchmarks.reliability_client import Result
from benchmarks.reliability_tenants import TenantLoad, jain, parse, render, tenant_summary, write_tenants_file
from benchmarks.reliability_workload import Mix
from runtime.gateway.tenants import tenants_file


def test_spec_parses_and_bad_specs_name_the_part():
    assert parse("heavy:40:20, light:5") == (TenantLoad("heavy", 40, 20), TenantLoad("light", 5))
    assert parse("") == ()
    for bad, message in (
        ("heavy", "name:streams"),
        ("a:x", "whole numbers"),
        ("a:0", ">= 1"),
        ("a:2:-1", ">= 0"),
        (":3", "name:streams"),
        ("a:1,a:2", "named twice"),
    ):
        with pytest.raises(ValueError, match=message):
            parse(bad)


def test_the_tenants_file_is_what_the_gateway_reads(tmp_path):
    tenants = parse("heavy:40:20,light:5")
    read = {t.name: t for t in tenants_file(write_tenants_file(tenants, tmp_path / "t.yaml"))}
    assert read["heavy"].limits.max_queued == 20 and read["light"].limits.max_queued is None
    assert read["heavy"].matches("sk-reliability-heavy") and not read["heavy"].matches("sk-reliability-light")


def test_burst_sends_each_tenants_streams_in_the_order_listed():
    planned = burst_jobs(0, Mix(answer_tokens=(16, 64)), 0, parse("heavy:3,light:2"))
    assert [(j.index, j.tenant, j.at) for j in planned] == [
        (0, "heavy", 0.0),
        (1, "heavy", 0.0),
        (2, "heavy", 0.0),
        (3, "light", 0.0),
        (4, "light", 0.0),
    ]
    assert [j.tenant for j in burst_jobs(2, Mix(), 0)] == [None, None]


def test_jain_index():
    assert jain([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert jain([3.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain([0.0, 0.0]) is None


def done(tenant: str, end: float, start: float = 0.0) -> Result:
    return Result(
        0,
        "rag",
        True,
        8,
        None,
        start,
        end=end,
        first_delta=start + 0.5,
        deltas=2,
        status=200,
        finished=True,
        tenant=tenant,
    )


def refused(tenant: str, wait: float | None) -> Result:
    return Result(
        0,
        "rag",
        True,
        8,
        None,
        0.0,
        end=0.1,
        status=429,
        reason="your tenant's request queue is full",
        code="overloaded",
        tenant=tenant,
        retry_after_s=wait,
    )


def test_per_tenant_outcomes_retry_after_and_fairness_window():
    """light's last answer at 10 s closes the window: heavy finished 4 by then (0.4/s), light 2 (0.2/s)."""
    results = [
        *(done("heavy", t) for t in (2.0, 4.0, 6.0, 8.0, 20.0, 30.0)),
        done("light", 5.0),
        done("light", 10.0),
        refused("heavy", 3.0),
        refused("heavy", 5.0),
        refused("heavy", None),
    ]
    section = tenant_summary(results, parse("heavy:9:2,light:2"))
    heavy, light = section["tenants"]["heavy"], section["tenants"]["light"]
    assert section["window_s"] == 10.0
    assert (heavy["completed"], heavy["refused"], heavy["refused_429"], heavy["retry_after_given"]) == (6, 3, 3, 2)
    assert heavy["retry_after_s"] == {"p50": 4.0, "min": 3.0, "max": 5.0} and light["retry_after_s"] == {}
    assert (heavy["completed_per_s_while_all_waited"], light["completed_per_s_while_all_waited"]) == (0.4, 0.2)
    assert section["jain"] == pytest.approx(0.6**2 / (2 * (0.4**2 + 0.2**2)))
    assert (heavy["last_completion_s"], light["ttft_ms"]["p50"]) == (30.0, 500.0)
    md = "\n".join(render(section, keyed=True))
    assert "| heavy | 9 | 2 | 6 | 3 (3) | 2 | 4.0 (3.0-5.0) | 500 / 500 | 30.0 | 0.4 |" in md
    assert "| light | 2 | - | 2 | 0 (0) | 0 | - |" in md and "0.900" in md


def test_a_tenant_that_got_nothing_gives_an_unfair_index():
    section = tenant_summary([done("heavy", 1.0), done("heavy", 2.0)], parse("heavy:2,light:2"))
    assert section["window_s"] == 2.0 and section["jain"] == pytest.approx(0.5)
    assert section["tenants"]["light"]["last_completion_s"] is None
