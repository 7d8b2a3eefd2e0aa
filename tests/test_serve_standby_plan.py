"""Whether `trtserve serve` keeps a warm spare by default: where memory holds two engines, for CPU backends; the KV
disk tier the two share; the measured check before the spare starts (runtime/cli_standby.py, serve/standby.py)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from engine_format import EngineConfig
from executors.kv_pool import pool_bytes
from runtime.cli_standby import RUNTIME_BYTES, engine_bytes, host_memory, plan_standby
from runtime.engine.engine_args import EngineArgs
from runtime.serve.standby import GiB, Memory, group_rss, spare_fits

PLENTY = Memory(available=64 * GiB, total=80 * GiB)


@pytest.fixture
def config(llama_engine: Path) -> EngineConfig:
    return EngineConfig.load(llama_engine)


def test_an_engines_estimate_is_its_files_its_kv_pool_and_the_runtime(config: EngineConfig):
    files = sum(f.stat().st_size for f in config.engine_dir.iterdir() if f.is_file())
    default_pool = pool_bytes(config, config.max_batch_size * config.max_blocks_per_seq)
    assert engine_bytes(config, EngineArgs()) == files + default_pool + RUNTIME_BYTES
    assert engine_bytes(config, EngineArgs(num_kv_blocks=7)) == files + pool_bytes(config, 7) + RUNTIME_BYTES


def test_by_default_a_spare_shares_a_temporary_disk_tier_removed_at_exit(config: EngineConfig):
    plan = plan_standby(None, config, EngineArgs(), PLENTY)
    assert plan.start and not plan.required
    assert plan.disk_dir is not None and plan.disk_dir.is_dir()
    assert plan.engine_args.kv_disk_cache == str(plan.disk_dir) and 0 < plan.engine_args.kv_disk_cache_gb <= 16
    assert str(plan.disk_dir) in plan.message and "--no-standby" in plan.message
    plan.cleanup()
    assert not plan.disk_dir.exists()


def test_a_disk_tier_the_user_names_is_the_one_shared(config: EngineConfig, tmp_path: Path):
    args = EngineArgs(kv_disk_cache=str(tmp_path), kv_disk_cache_gb=2.0)
    plan = plan_standby(None, config, args, PLENTY)
    assert plan.start and plan.engine_args == args and plan.disk_dir is None


def test_too_little_memory_means_no_spare_unless_asked_for(config: EngineConfig):
    need = 2 * engine_bytes(config, EngineArgs()) + PLENTY.reserve
    short = Memory(available=need - 1, total=PLENTY.total)
    plan = plan_standby(None, config, EngineArgs(), short)
    assert not plan.start and plan.disk_dir is None and plan.engine_args == EngineArgs()
    assert plan.message.startswith("no warm spare:") and "two engines need" in plan.message
    assert "--standby starts one anyway" in plan.message
    assert plan_standby(None, config, EngineArgs(), dataclasses.replace(short, available=need)).start
    asked = plan_standby(True, config, EngineArgs(), short)
    assert asked.start and asked.required
    asked.cleanup()


def test_a_gpu_backend_gets_no_spare_by_default_and_no_flag_means_none(config: EngineConfig):
    plan = plan_standby(None, config, EngineArgs(backend="torch"), PLENTY)
    assert not plan.start and "the torch backend's engine is in a GPU's memory" in plan.message
    asked = plan_standby(True, config, EngineArgs(backend="torch"), PLENTY)
    assert asked.start and asked.disk_dir is None  # a GPU pool's tier is the user's to set up
    off = plan_standby(False, config, EngineArgs(), PLENTY)
    assert not off.start and off.message == "" and off.disk_dir is None


def test_the_measured_check_compares_the_serving_engines_size_with_what_is_free():
    me = os.getpgrp()
    size = group_rss(me)
    assert size > 10 * 2**20  # this test's own process group: at least this interpreter
    roomy = Memory(available=size + 4 * GiB, total=8 * GiB)  # reserve: 2 GiB
    assert spare_fits(me, roomy) is None
    tight = Memory(available=size + GiB, total=8 * GiB)
    assert "a second engine of" in (spare_fits(me, tight) or "")
    assert group_rss(2**22 + 12345) == 0  # no such process group


def test_host_memory_reads_this_machine():
    memory = host_memory()
    assert 0 < memory.available <= memory.total
    assert memory.reserve >= 2 * GiB
