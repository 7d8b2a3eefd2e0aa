"""The KV cache's host and disk tiers (runtime/engine/kv_tiers/): greedy output token-identical whether a prefix
came from the pool, a tier or was recomputed (checked against the sequential greedy reference), exact block ids
and tier contents after a scripted eviction sequence, refused files, shared and restarted disk tiers, and tenant
isolation by cache salt."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine_format import EngineConfig
from executors import create_backend
from executors.greedy import greedy_generate
from executors.kv_blocks import BlockCopier
from runtime import LLM, EngineArgs, LLMEngine, SamplingParams
from runtime.engine.kv_cache_manager import block_hash, salt_root
from runtime.engine.kv_tiers.disk import HEADER, DiskTier
from runtime.engine.kv_tiers.host import HostTier
from runtime.triton_model.metrics import TritonMetrics
from tests.conftest import TINY_BLOCK_SIZE
from tests.gateway_helpers import running_servers
from tests.helpers import FLOAT32_BACKEND, random_prompts
from tests.test_kv_quant_engine import LOOSE, _build, _gate
from tests.test_slo_serving import FakePbUtils
from tests.triton_helpers import metrics, running_server, sse_events, wait_for

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BS = TINY_BLOCK_SIZE


@pytest.fixture(scope="module")
def reference(llama_engine):
    config = EngineConfig.load(llama_engine)
    backend = create_backend(config, kind="graph")
    return lambda prompt: greedy_generate(backend, [prompt], GREEDY.max_tokens, ())[0]  # () : EOS ignored


@pytest.fixture(scope="module")
def kv_int8_engine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("kv_tiers_int8")
    _build(root / "tiny-llama-kv-int8", "int8", _gate(root, LOOSE))
    return root / "tiny-llama-kv-int8"


def _engine(engine_dir: Path, **settings) -> LLMEngine:
    return LLMEngine(engine_dir, EngineArgs(backend=FLOAT32_BACKEND, max_num_seqs=2, **settings))


def _run(engine: LLMEngine, prompt: list[int], salt: str | None = None) -> list[int]:
    """One request alone to its end, the engine's invariants checked each step (tier holds included), then its
    blocks' copies to the tiers waited for."""
    params = GREEDY if salt is None else SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, cache_salt=salt)
    request_id = engine.add_request(prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step_tokens():
            assert out.request_id == request_id
            tokens += out.token_ids
        engine.check_invariants()
    engine.kv.sync_tiers(settle=True)
    engine.check_invariants()
    return tokens


def _hashes(prompt: list[int], salt: str | None = None) -> list[bytes]:
    out, parent = [], salt_root(salt)
    for i in range(len(prompt) // BS):
        parent = block_hash(parent, prompt[i * BS : (i + 1) * BS])
        out.append(parent)
    return out


def _docs(vocab: int, n: int, blocks: int = 4) -> list[list[int]]:
    """n prompts of `blocks` full blocks plus 3 tokens, sharing nothing."""
    return random_prompts(vocab, [blocks * BS + 3] * n, seed=11)


# ---- the tiers alone -----------------------------------------------------------------------------------------


def test_host_tier_is_a_bounded_lru():
    tier = HostTier(capacity_bytes=3 * 100)
    block = [np.full(100, i, np.uint8) for i in range(5)]
    for i in range(3):
        assert tier.put(bytes([i]), block[i]) == []
    assert tier.get(bytes([0])) is block[0]  # 0 is now the most recent: 1 goes first
    evicted = tier.put(bytes([3]), block[3])
    assert [h for h, _ in evicted] == [bytes([1])]
    assert [h for h, _ in tier.items()] == [bytes([2]), bytes([0]), bytes([3])]
    assert tier.usage_bytes == 300
    too_large = np.zeros(301, np.uint8)
    assert tier.put(bytes([9]), too_large)[0][1] is too_large and len(tier) == 3  # passed on, not kept


def test_disk_tier_refuses_corrupt_truncated_and_foreign_files(tmp_path, caplog):
    identity = {"engine": "a"}
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20, identity=identity, block_bytes=64)
    payloads = {bytes([i]) * 16: np.arange(64, dtype=np.uint8) + i for i in range(4)}
    for h, p in payloads.items():
        assert tier.write(h, p)
    good, flipped, cut, foreign = list(payloads)
    data = bytearray(tier.path(flipped).read_bytes())
    data[HEADER.size + 5] ^= 0xFF  # one payload bit: the checksum catches it
    tier.path(flipped).write_bytes(bytes(data))
    tier.path(cut).write_bytes(tier.path(cut).read_bytes()[:-1])
    other = DiskTier(tmp_path, 1 << 20, {"engine": "b"}, 64)  # another engine's file under this one's name
    other.write(foreign, payloads[foreign])
    shutil.copy(other.path(foreign), tier.path(foreign))
    with caplog.at_level(logging.WARNING):
        assert np.array_equal(tier.read(good), payloads[good])
        assert tier.read(flipped) is None and tier.read(cut) is None and tier.read(foreign) is None
    assert tier.rejected == 3
    assert "checksum mismatch" in caplog.text and "another engine" in caplog.text
    assert not tier.path(flipped).exists() and flipped not in tier  # deleted, never loaded
    assert np.array_equal(other.read(foreign), payloads[foreign])  # the other engine's own copy is fine


def test_disk_tier_is_bounded_and_found_again_after_a_restart(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=3 * (HEADER.size + 32), identity={"e": 1}, block_bytes=32)
    for i in range(5):
        tier.write(bytes([i]) * 16, np.full(32, i, np.uint8))
    assert [bytes([i]) * 16 in tier for i in range(5)] == [False, False, True, True, True]  # oldest deleted
    again = DiskTier(tmp_path, 1 << 20, {"e": 1}, 32)
    assert len(again) == 3 and np.array_equal(again.read(bytes([4]) * 16), np.full(32, 4, np.uint8))


def test_a_failing_write_is_counted_and_the_tier_goes_on(tmp_path, caplog):
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20, identity={"e": 1}, block_bytes=8)
    blocked = bytes([0xAB]) * 16
    tier.path(blocked).parent.write_text("a file where the block's directory goes")  # mkdir fails: an OSError
    with caplog.at_level(logging.WARNING):
        assert not tier.write(blocked, np.zeros(8, np.uint8))
    assert tier.write_errors == 1 and "writing a block" in caplog.text and blocked not in tier
    assert tier.write(bytes([1]) * 16, np.ones(8, np.uint8)) and bytes([1]) * 16 in tier  # others still written


def test_an_unusable_disk_directory_is_a_warning_not_a_crash(llama_engine, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        engine = _engine(llama_engine, num_kv_blocks=16, kv_disk_cache=str(blocker / "kv"))
    assert engine.kv.tiers is None and "cannot be used" in caplog.text
    prompt = _docs(engine.config.model.vocab_size, 1)[0]
    assert len(_run(engine, prompt)) == GREEDY.max_tokens


def test_block_copier_round_trips_a_pool_with_scales(kv_int8_engine):
    config = EngineConfig.load(kv_int8_engine)
    backend = create_backend(config, num_blocks=8, kind="cpu")
    copier = BlockCopier(backend, config)
    assert len(copier.buffers) == 2  # int8 codes and their row scales
    rng = np.random.default_rng(0)
    payloads = rng.integers(0, 256, (2, copier.block_bytes), dtype=np.uint8)
    before = copier.gather(range(8))
    copier.scatter([5, 2], payloads)
    assert np.array_equal(copier.gather([2, 5]), payloads[::-1])
    others = [0, 1, 3, 4, 6, 7]
    assert np.array_equal(copier.gather(others), before[others])  # other blocks untouched
    with pytest.raises(ValueError, match="shape"):
        copier.scatter([1], payloads)


# ---- in the engine -------------------------------------------------------------------------------------------


def test_scripted_eviction_reads_blocks_back_from_the_host_tier(llama_engine, reference):
    # Each document (4 full blocks, a 3-token tail, 6 answer tokens) computes 5 full blocks (ids in the pool's
    # free order), freed tail first; a block's copy to the tier pins it, so a's fifth block (4) goes back last.
    # a: 0-4, free [5-9, 3, 2, 1, 0, 4]; b: 5-9, free [3, 2, 1, 0, 4, 8, 7, 6, 5, 9]; c: 3, 2, 1, 0, 4 (a evicted).
    engine = _engine(llama_engine, num_kv_blocks=10, kv_host_cache_gb=0.01)
    tiers = engine.kv.tiers
    assert tiers is not None and tiers.host is not None
    a, b, c = _docs(engine.config.model.vocab_size, 3)
    computed = {}
    for name, prompt in (("a", a), ("b", b), ("c", c)):
        answer = _run(engine, prompt)
        assert answer == reference(prompt)
        computed[name] = _hashes((prompt + answer)[:-1])  # the last token's K/V is never computed
        assert len(computed[name]) == 5
    assert [h for h, _ in tiers.host.items()] == computed["a"] + computed["b"] + computed["c"]  # written through
    assert [engine.kv.pool.lookup(h) for h in _hashes(a)] == [None] * 4  # a's blocks left the pool
    assert _run(engine, a) == reference(a)  # read back, not recomputed
    stats = engine.stats().kv_tiers
    assert stats is not None and stats.hits == {"host": 4} and stats.loads == 1
    assert engine.stats().prefix_cache_hits == 4 * BS
    # The load took the free queue's first four blocks, b's first four: [8, 7, 6, 5, 9, ...] after c.
    assert [engine.kv.pool.lookup(h).block_id for h in _hashes(a)] == [8, 7, 6, 5]
    assert [engine.kv.pool.lookup(h) for h in computed["b"][:4]] == [None] * 4
    # Read from the host tier, a's prompt blocks became its most recently used; its answer block was kept.
    assert [h for h, _ in tiers.host.items()] == computed["a"][4:] + computed["b"] + computed["c"] + _hashes(a)


@pytest.mark.parametrize("tiers", ["host", "disk", "host+disk"])
def test_greedy_output_is_the_same_from_every_tier(llama_engine, reference, tmp_path, tiers):
    settings = {
        "host": {"kv_host_cache_gb": 0.01},
        "disk": {"kv_disk_cache": str(tmp_path)},
        "host+disk": {"kv_host_cache_gb": 0.00002, "kv_disk_cache": str(tmp_path)},  # a host tier of 5 blocks
    }[tiers]
    engine = _engine(llama_engine, num_kv_blocks=12, **settings)
    docs = _docs(engine.config.model.vocab_size, 4)
    for prompt in docs + docs[::-1]:
        assert _run(engine, prompt) == reference(prompt)
    stats = engine.stats().kv_tiers
    assert stats is not None and sum(stats.hits.values()) >= 8, stats
    if "disk" in tiers:
        assert stats.hits.get("disk", 0) > 0 and stats.stored["disk"] > 0


def test_int8_kv_stays_int8_in_the_tiers(kv_int8_engine, tmp_path):
    plain = LLMEngine(kv_int8_engine, EngineArgs(backend="cpu", num_kv_blocks=64))
    tiered = LLMEngine(kv_int8_engine, EngineArgs(backend="cpu", num_kv_blocks=12, kv_disk_cache=str(tmp_path)))
    docs = _docs(plain.config.model.vocab_size, 3)
    want = [_run(plain, p) for p in docs + docs]
    assert [_run(tiered, p) for p in docs + docs] == want
    stats = tiered.stats().kv_tiers
    assert stats is not None and stats.hits.get("disk", 0) >= 4
    per_block = BlockCopier(tiered.backend, tiered.config).block_bytes
    spec = tiered.config.model
    assert per_block == spec.num_layers * 2 * BS * (spec.kv_width + 4 * spec.num_kv_heads)  # codes + f32 scales


def test_smollm2_answers_the_same_from_the_tiers(smollm2_engine, tmp_path):
    docs = [f"Document {i}: " + " ".join(f"fact {i}.{j} is worth remembering" for j in range(24)) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    recomputed = LLM(smollm2_engine, num_kv_blocks=64, enable_prefix_caching=False).generate(docs, params)
    # ~210 tokens a document: 3 full blocks of 64 and the rest; the pool holds one document, the host tier 3 blocks.
    assert EngineConfig.load(smollm2_engine).block_size == 64
    small = {"num_kv_blocks": 5, "kv_host_cache_gb": 0.01, "kv_disk_cache": str(tmp_path)}
    with LLM(smollm2_engine, **small) as tiered:
        answers = [tiered.generate(d, params)[0] for d in docs + docs]
        stats = tiered.engine.stats().kv_tiers
    assert [a.token_ids for a in answers] == [r.token_ids for r in recomputed + recomputed]
    assert stats is not None and sum(stats.hits.values()) >= 6, stats  # two documents' 3 blocks read back at least


def test_a_restart_and_a_second_replica_read_the_disk_tier(llama_engine, reference, tmp_path):
    tiers = {"kv_host_cache_gb": 0.01, "kv_disk_cache": str(tmp_path)}
    first = LLM(llama_engine, backend=FLOAT32_BACKEND, num_kv_blocks=32, **tiers)
    replica = _engine(llama_engine, num_kv_blocks=32, kv_disk_cache=str(tmp_path))  # beside it, one directory
    doc, other = _docs(first.engine.config.model.vocab_size, 2)
    assert _run(first.engine, doc) == reference(doc)
    assert _run(replica, doc) == reference(doc)  # written through to disk as `first` computed it
    assert replica.stats().kv_tiers.hits == {"disk": 4}
    assert _run(first.engine, other) == reference(other)
    first.close()
    restarted = _engine(llama_engine, num_kv_blocks=32, kv_disk_cache=str(tmp_path))
    for prompt in (doc, other):
        assert _run(restarted, prompt) == reference(prompt)
    assert restarted.stats().kv_tiers.hits == {"disk": 8}


def test_the_shutdown_writes_what_the_disk_tier_lacks(llama_engine, reference, tmp_path):
    engine = _engine(llama_engine, num_kv_blocks=32, kv_host_cache_gb=0.01, kv_disk_cache=str(tmp_path))
    doc = _docs(engine.config.model.vocab_size, 1)[0]
    answer = _run(engine, doc)
    tiers = engine.kv.tiers
    assert tiers is not None and tiers.disk is not None
    lost = _hashes((doc + answer)[:-1])[1:3]  # as if their writes had failed
    for h in lost:
        tiers.disk.path(h).unlink()
        tiers.disk._forget(h)
    engine.close()
    restarted = _engine(llama_engine, num_kv_blocks=32, kv_disk_cache=str(tmp_path))
    assert all(h in restarted.kv.tiers.disk for h in lost)
    assert _run(restarted, doc) == reference(doc)
    assert restarted.stats().kv_tiers.hits == {"disk": 4}


def test_a_salt_never_reads_another_tenants_blocks_from_a_tier(llama_engine, reference, tmp_path):
    engine = _engine(llama_engine, num_kv_blocks=12, kv_host_cache_gb=0.01, kv_disk_cache=str(tmp_path))
    a, b, c = _docs(engine.config.model.vocab_size, 3)
    _run(engine, a, salt="tenant-a")
    _run(engine, b), _run(engine, c)  # a's blocks leave the pool
    assert _run(engine, a, salt="tenant-b") == reference(a)
    assert engine.stats().kv_tiers.hits == {}  # another salt: other hashes, a miss in every tier
    engine.close()
    restarted = _engine(llama_engine, num_kv_blocks=12, kv_disk_cache=str(tmp_path))
    _run(restarted, a)  # no salt: a miss too
    assert restarted.stats().kv_tiers.hits == {}
    _run(restarted, a, salt="tenant-a")
    assert restarted.stats().kv_tiers.hits == {"disk": 4}


def test_a_block_evicted_before_its_copy_is_queued_is_not_stored(llama_engine):
    engine = _engine(llama_engine, num_kv_blocks=10, kv_host_cache_gb=0.01)
    tiers = engine.kv.tiers
    assert tiers is not None and tiers.host is not None
    engine.add_request(_docs(engine.config.model.vocab_size, 1)[0], GREEDY)
    while engine.has_unfinished_requests():
        engine.step_tokens()
    pending = list(engine.kv._newly_cached)  # indexed by the last step: queued at the next step's sync
    assert pending
    pool = engine.kv.pool
    taken = pool.get_new_blocks(pool.num_free_blocks)  # between steps (a disaggregated pull): they are evicted
    engine.kv.sync_tiers(settle=True)
    assert not [h for _, h in pending if h in tiers.host]  # their blocks hold other data now
    pool.free_blocks(taken)
    engine.check_invariants()


def test_a_request_aborted_while_its_blocks_load_leaks_nothing(llama_engine, tmp_path):
    engine = _engine(llama_engine, num_kv_blocks=12, kv_disk_cache=str(tmp_path))
    a, b, c = _docs(engine.config.model.vocab_size, 3)
    for prompt in (a, b, c):
        _run(engine, prompt)
    request_id = engine.add_request(a, GREEDY)
    with engine._lock:
        engine.scheduler.schedule()  # starts the load; the request waits for it
    assert engine.kv.tiers is not None and engine.kv.tiers.load_state(request_id) is not None
    engine.abort(request_id)
    engine.check_invariants()  # the copy's blocks are still held while it runs
    engine.close()  # waits for the copy thread
    engine.kv.check_invariants([], held=[])
    assert engine.kv.pool.counts()["used"] == 0


# ---- served --------------------------------------------------------------------------------------------------


def test_tier_metrics_are_exported_only_with_tiers(llama_engine, tmp_path):
    engine = _engine(llama_engine, num_kv_blocks=10, kv_host_cache_gb=0.01, kv_disk_cache=str(tmp_path))
    docs = _docs(engine.config.model.vocab_size, 3)
    for prompt in [*docs, docs[0]]:
        _run(engine, prompt)
    metrics = TritonMetrics(FakePbUtils, {"model": "llm", "version": "1"}, kv_tiers=True)
    metrics.update(engine.stats())
    labelled = {name: {t: m.value for t, m in by_tier.items()} for name, by_tier in metrics.labelled.items()}
    assert labelled["trtserve_kv_tier_hits_total"] == {"host": 4}
    assert labelled["trtserve_kv_tier_stored_blocks_total"] == {"host": 15, "disk": 15}
    assert labelled["trtserve_kv_tier_blocks"] == {"host": 15, "disk": 15}
    assert metrics.counters["trtserve_kv_tier_loads_total"].value == 1
    off = TritonMetrics(FakePbUtils, {"model": "llm", "version": "1"})
    off.update(_engine(llama_engine).stats())
    assert not [n for n in [*off.counters, *off.gauges, *off.labelled] if "kv_tier" in n]


@pytest.mark.serving
def test_served_replicas_share_the_disk_tier_and_a_restart_reads_it(llama_engine, tmp_path):
    params = {"kv_disk_cache": str(tmp_path), "kv_host_cache_gb": "0.01"}
    document = " ".join(f"section {i} of the shared document says something else" for i in range(5))  # ~155 tokens
    body = {"text_input": document, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}

    def disk_hits(server) -> float:
        values = metrics(server).items()
        return sum(v for k, v in values if k.startswith("trtserve_kv_tier_hits_total{") and 'tier="disk"' in k)

    with running_servers(llama_engine, 2, params) as (first, second):
        want = "".join(e["text_output"] for e in sse_events(first, body))
        assert "".join(e["text_output"] for e in sse_events(second, body)) == want
        assert wait_for(lambda: disk_hits(second) > 0), metrics(second)  # computed by the other replica
    with running_server(llama_engine, params) as restarted:
        assert "".join(e["text_output"] for e in sse_events(restarted, body)) == want
        assert wait_for(lambda: disk_hits(restarted) > 0), metrics(restarted)
