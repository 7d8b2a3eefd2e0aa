"""Scale-out against live tritonservers: three replicas of a slow random Llama (a 1,500-token request stays
in flight for seconds while the test acts) behind one gateway process.

- Prefix routing sends requests sharing a long system prompt to one replica, and the replicas' own
  prefix-cache counters (vLLM's names) show more hits than round-robin gets on the same traffic.
- Under skewed load the router falls back to the least loaded replica.
- The engine's vLLM-named gauges and counters read right against a known load, and the gateway's view
  of each replica (scraped) agrees.
- A replica added at run time (admin API) receives traffic; removed, it receives none.
- A replica killed mid-run loses no request that had not streamed a token (retried elsewhere), a stream
  under way there is resumed on another, the others keep serving, and it serves again once restarted.

Every test starts and ends with every engine idle (nothing running, waiting or holding KV blocks).
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import yaml

from runtime.serve.launcher import ServerConfig, TritonServer
from tests.gateway_helpers import (
    admin,
    build_slow_engine,
    client,
    engine_metrics,
    gateway_metrics,
    replica_entry,
    running_gateway,
    running_servers,
)
from tests.triton_helpers import wait_for

pytestmark = pytest.mark.serving
KEY = "sk-replicas-0123"
BLOCK = 16  # the slow engine's KV block size (build_slow_engine)
LONG = {"max_tokens": 1500, "temperature": 0, "extra_body": {"ignore_eos": True}}
# A system prompt long enough for many KV blocks; each test prefixes it with its own tag, so no test
# reuses another's cached prefix.
SYSTEM = ("You are the operations assistant of a regional rail network. Answer in plain words, cite the "
          "timetable section you used, and say when a connection cannot be made. ") * 3  # fmt: skip
ENGINE_PARAMS = {"max_num_seqs": "2", "cancel_poll_s": "0"}
ROUTING = {"policy": "prefix", "balance_abs": 2, "balance_rel": 1.0, "health_interval_s": 0.3,
           "metrics_interval_s": 0.2}  # fmt: skip


def messages(tag: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"{tag}: {SYSTEM}"}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def engine(engines_dir):
    return build_slow_engine(engines_dir)


@pytest.fixture(scope="module")
def replicas(engine):
    with running_servers(engine, 3, ENGINE_PARAMS) as servers:
        yield servers


def write_config(path, backends: dict, routing: dict = ROUTING):
    path.write_text(yaml.safe_dump({"routing": routing, "backends": backends}, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def gateway(replicas, tmp_path_factory):
    """`slow` routes by prefix, `slow-rr` round-robin over the same replicas; `slow-grow` starts on the
    first, `slow-pinned` is the third alone."""
    entries = [replica_entry(s) for s in replicas]
    config = write_config(tmp_path_factory.mktemp("gateway") / "gateway.yaml", {
        "slow": {"replicas": entries},
        "slow-rr": {"replicas": entries, "routing": "round_robin"},
        "slow-grow": {"replicas": entries[:1], "routing": "round_robin"},
        "slow-pinned": {"replicas": entries[2:]},
    })  # fmt: skip
    with running_gateway(None, None, "--config", str(config), api_key=KEY) as gw:
        yield gw


@pytest.fixture(scope="module")
def sdk(gateway) -> openai.OpenAI:
    return client(gateway.url, KEY)


def idle(server: TritonServer) -> bool:
    values = engine_metrics(server)
    return all(values.get(name, 1) == 0 for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "trtserve_kv_cache_used_blocks"))  # fmt: skip


@pytest.fixture(autouse=True)
def idle_engines(replicas, gateway):
    """Engines idle, and the gateway has seen them idle (its scraped load is 0), before and after."""

    def all_idle() -> bool:
        seen = gateway_metrics(gateway)
        scraped = [v for k, v in seen.items() if k.startswith(("trtserve_gateway_replica_running",
                                                                "trtserve_gateway_replica_waiting"))]  # fmt: skip
        return all(idle(s) for s in replicas) and not any(scraped)

    assert wait_for(all_idle, timeout_s=60)
    yield
    assert wait_for(all_idle, timeout_s=60), [engine_metrics(s) for s in replicas]


def counters(servers: list[TritonServer]) -> list[tuple[float, float]]:
    """(prefix-cache queries, hits) per replica, from vLLM's names."""
    values = [engine_metrics(s) for s in servers]
    return [(v["vllm:prefix_cache_queries_total"], v["vllm:prefix_cache_hits_total"]) for v in values]


def settled_counters(servers: list[TritonServer], prompt_tokens: int, before: list[tuple[float, float]]):
    """Counters once `prompt_tokens` more queries are counted (the model publishes every 0.5 s) and two
    reads in a row agree (queries and hits are published one after the other)."""
    reads: list[list[tuple[float, float]]] = []

    def settled() -> bool:
        reads.append(counters(servers))
        counted = sum(q for q, _ in reads[-1]) - sum(q for q, _ in before) == prompt_tokens
        return counted and len(reads) > 1 and reads[-1] == reads[-2]

    assert wait_for(settled, timeout_s=30), (reads[-1:], before, prompt_tokens)
    return reads[-1]


def changed(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def picks(gateway, backend: str) -> dict[tuple[str, str], float]:
    """(replica, reason) -> picks so far for `backend`."""
    out = {}
    for key, value in gateway_metrics(gateway).items():
        if key.startswith("trtserve_gateway_replica_picks_total{") and f'backend="{backend}"' in key:
            labels = dict(part.split("=", 1) for part in key[key.index("{") + 1 : -1].split(","))
            out[(labels["replica"].strip('"'), labels["reason"].strip('"'))] = value
    return out


def test_a_shared_system_prompt_concentrates_on_one_replica_and_hits_more_than_round_robin(sdk, gateway, replicas):
    urls = [replica_entry(s)["url"] for s in replicas]
    questions = [f"Question {i}: when does the train to station {i} leave?" for i in range(9)]
    measured = {}
    first_picks = picks(gateway, "slow")
    for backend, tag in (("slow-rr", "RR"), ("slow", "PX")):
        before = counters(replicas)
        prompts = 0
        for question in questions:  # one after another: load stays balanced
            reply = sdk.chat.completions.create(model=backend, messages=messages(tag, question), max_tokens=2,
                                                temperature=0)  # fmt: skip
            prompts += reply.usage.prompt_tokens
        after = settled_counters(replicas, prompts, before)
        queries = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
        hits = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
        assert sum(queries) == prompts  # every prompt token looked up once, on the replica that served it
        measured[backend] = (queries, sum(hits))
    rr_queries, rr_hits = measured["slow-rr"]
    px_queries, px_hits = measured["slow"]
    assert all(q > 0 for q in rr_queries)  # round robin: three requests on each replica
    assert sorted(q > 0 for q in px_queries) == [False, False, True]  # prefix: all nine on one replica
    # Each repeat of the system prompt on a replica that computed it hits the same H tokens (whole
    # blocks); round robin computes it once per replica (6 repeats), prefix routing once (8 repeats).
    per_repeat = px_hits / 8
    assert per_repeat > 0 and per_repeat % BLOCK == 0
    assert rr_hits == 6 * per_repeat
    assert px_hits / sum(px_queries) > rr_hits / sum(rr_queries)
    chosen = urls[px_queries.index(max(px_queries))]
    assert changed(first_picks, picks(gateway, "slow")) == {(chosen, "no_prefix_match"): 1, (chosen, "prefix_match"): 8}


def started_stream(sdk: openai.OpenAI, model: str, msgs: list[dict[str, str]]):
    """A long streamed chat whose first chunk has arrived: its replica was picked and counts it."""
    stream = sdk.chat.completions.create(model=model, messages=msgs, stream=True, **LONG)
    assert next(iter(stream)).choices[0].delta.role == "assistant"
    return stream


def test_skewed_load_falls_back_to_the_least_loaded_replica(sdk, gateway, replicas):
    """balance_abs 2: the third request sharing a prefix leaves its replica (2 open vs 0), the fourth
    follows the prefix to the less loaded of the two replicas that now hold it."""
    before = picks(gateway, "slow")
    streams = []
    try:
        for i in range(4):
            streams.append(started_stream(sdk, "slow", messages("SKEW", f"Tell me about line {i}.")))
        made = changed(before, picks(gateway, "slow"))
        [first] = [url for (url, reason) in made if reason == "no_prefix_match"]
        [second] = [url for (url, reason) in made if reason == "imbalance"]
        assert made == {(first, "no_prefix_match"): 1, (first, "prefix_match"): 1, (second, "imbalance"): 1,
                        (second, "prefix_match"): 1}  # fmt: skip

        def running() -> dict[str, float]:
            return {replica_entry(s)["url"]: engine_metrics(s)["vllm:num_requests_running"] for s in replicas}

        assert wait_for(lambda: sorted(running().values()) == [0, 2, 2]), running()
        assert running()[first] == running()[second] == 2
    finally:
        for stream in streams:
            stream.close()


def test_vllm_named_metrics_read_right_against_a_known_load(sdk, gateway, replicas):
    """A prompt sent twice hits its whole full blocks (all but the last token) the second time; three long
    requests on a replica running two at a time read 2 running, 1 waiting and KV in use, on the replica
    and in the gateway's scraped view of it."""
    target, url = replicas[2], replica_entry(replicas[2])["url"]
    before = engine_metrics(target)
    text = "Timetable change notice for the northern corridor, effective next Monday morning. " * 2
    usage = [sdk.completions.create(model="slow-pinned", prompt=text, max_tokens=1).usage for _ in range(2)]
    n = usage[0].prompt_tokens
    after = settled_counters([target], 2 * n, [(before["vllm:prefix_cache_queries_total"],
                                                before["vllm:prefix_cache_hits_total"])])[0]  # fmt: skip
    assert after[1] - before["vllm:prefix_cache_hits_total"] == (n - 1) // BLOCK * BLOCK
    values = engine_metrics(target)
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert values[f"vllm:{name}"] == values[f"trtserve_{name}"]

    streams = [started_stream(sdk, "slow-pinned", messages("LOAD", f"Line {i}?")) for i in range(2)]
    try:
        with ThreadPoolExecutor(1) as pool:
            third = pool.submit(lambda: sdk.chat.completions.create(
                model="slow-pinned", messages=messages("LOAD", "Line 2?"), max_tokens=3, temperature=0))  # fmt: skip

            def loaded() -> bool:
                values = engine_metrics(target)
                usage = values["vllm:kv_cache_usage_perc"]
                return ((values["vllm:num_requests_running"], values["vllm:num_requests_waiting"]) == (2, 1)
                        and 0 < usage < 1 and usage == values["trtserve_kv_cache_usage_ratio"])  # fmt: skip

            assert wait_for(loaded, timeout_s=30), engine_metrics(target)
            labels = f'{{backend="slow-pinned",replica="{url}"}}'
            seen = gateway_metrics(gateway)
            assert seen[f"trtserve_gateway_replica_in_flight{labels}"] == 3

            def scraped() -> tuple[float, float]:
                seen = gateway_metrics(gateway)
                return seen[f"trtserve_gateway_replica_running{labels}"], seen[
                    f"trtserve_gateway_replica_waiting{labels}"
                ]

            assert wait_for(lambda: scraped() == (2, 1)), scraped()
            for stream in streams:
                stream.close()
            assert third.result(timeout=120).usage.completion_tokens == 3
    finally:
        for stream in streams:
            stream.close()


def test_a_replica_added_at_run_time_receives_traffic_until_removed(sdk, gateway, replicas):
    new = replica_entry(replicas[1])
    path = "/admin/backends/slow-grow/replicas"
    assert admin(gateway, "POST", path, new)[0] == 401  # no key
    assert admin(gateway, "POST", path, new, api_key="sk-wrong")[0] == 401
    assert admin(gateway, "POST", "/admin/backends/nope/replicas", new, KEY)[0] == 404
    status, body = admin(gateway, "POST", path, {"url": "not-a-host"}, KEY)
    assert (status, body["error"]["param"]) == (400, "url")
    status, body = admin(gateway, "POST", path, new, KEY)
    assert status == 201 and body["url"] == new["url"] and body["healthy"] is True
    assert admin(gateway, "POST", path, new, KEY)[0] == 409

    before = engine_metrics(replicas[1])["vllm:prefix_cache_queries_total"]
    for i in range(4):
        sdk.completions.create(model="slow-grow", prompt=f"Stop {i} of the grow line", max_tokens=1)
    served = {url for (url, _) in picks(gateway, "slow-grow")}
    assert served == {replica_entry(replicas[0])["url"], new["url"]}
    assert wait_for(lambda: engine_metrics(replicas[1])["vllm:prefix_cache_queries_total"] > before)
    listed = admin(gateway, "GET", "/admin/replicas", api_key=KEY)[1]["backends"]["slow-grow"]
    assert [r["url"] for r in listed["replicas"]] == [replica_entry(replicas[0])["url"], new["url"]]

    status, body = admin(gateway, "DELETE", f"{path}/{new['url']}", api_key=KEY)
    assert (status, body["url"]) == (200, new["url"])
    assert admin(gateway, "DELETE", f"{path}/{new['url']}", api_key=KEY)[0] == 404
    assert admin(gateway, "DELETE", f"{path}/{replica_entry(replicas[0])['url']}", api_key=KEY)[0] == 409  # last
    counts = picks(gateway, "slow-grow")
    for i in range(2):
        sdk.completions.create(model="slow-grow", prompt=f"Stop {i} after the removal", max_tokens=1)
    after = picks(gateway, "slow-grow")
    assert {k: after[k] - counts.get(k, 0) for k in after if after[k] != counts.get(k, 0)} == {
        (replica_entry(replicas[0])["url"], "round_robin"): 2
    }


def test_a_killed_replica_loses_no_unstarted_request_and_serves_again_once_back(engine, replicas, tmp_path):
    """One replica running one request at a time: a stream under way there and three requests waiting
    behind it. A second replica joins; the first is killed: the stream is resumed on the second, and the
    waiting three are answered there, which keeps serving. Restarted on its ports, the first serves again."""
    doomed = TritonServer(ServerConfig.on_free_ports(engine, engine_params={**ENGINE_PARAMS, "max_num_seqs": "1"}))
    revived: TritonServer | None = None
    try:
        doomed.wait_ready(timeout_s=180)
        doomed_url = replica_entry(doomed)["url"]
        health = f'trtserve_gateway_replica_healthy{{backend="slow",replica="{doomed_url}"}}'
        routing = {**ROUTING, "policy": "round_robin"}
        path = write_config(tmp_path / "gateway.yaml", {"slow": {"replicas": [replica_entry(doomed)]}}, routing)
        with running_gateway(None, None, "--config", str(path), api_key=KEY) as gw:
            sdk = client(gw.url, KEY)
            stream = started_stream(sdk, "slow", messages("KILL", "Tell me everything."))
            with ThreadPoolExecutor(3) as pool:
                waiting = [pool.submit(lambda i=i: list(sdk.chat.completions.create(
                    model="slow", messages=messages("KILL", f"Short answer {i}."), max_tokens=5, temperature=0,
                    extra_body={"ignore_eos": True}, stream=True, stream_options={"include_usage": True})))
                    for i in range(3)]  # fmt: skip
                assert wait_for(lambda: engine_metrics(doomed)["vllm:num_requests_waiting"] == 3, timeout_s=30)
                assert admin(gw, "POST", "/admin/backends/slow/replicas", replica_entry(replicas[0]), KEY)[0] == 201
                os.killpg(doomed.process.pid, signal.SIGKILL)  # tritonserver and its model's stub
                ends = [c.choices[0].finish_reason for c in stream if c.choices]  # resumed on the survivor
                assert ends[-1] == "length" and ends.count("length") == 1
                for future in waiting:  # retried on the survivor: every token arrives
                    *content, usage = future.result(timeout=120)
                    assert usage.usage.completion_tokens == 5 and content[-1].choices[0].finish_reason == "length"
            retries = f'trtserve_gateway_replica_retries_total{{backend="slow",replica="{doomed_url}"}}'
            assert gateway_metrics(gw)[retries] == 3
            resumed = f'trtserve_gateway_streams_resumed_total{{backend="slow",replica="{doomed_url}"}}'
            assert gateway_metrics(gw)[resumed] == 1
            assert wait_for(lambda: gateway_metrics(gw)[health] == 0)
            reply = sdk.chat.completions.create(model="slow", messages=messages("KILL", "Still there?"), max_tokens=2)
            assert reply.usage.completion_tokens == 2

            doomed.process.wait()
            revived = TritonServer(doomed.config)  # the same ports: the address the gateway knows
            revived.wait_ready(timeout_s=180)
            assert wait_for(lambda: gateway_metrics(gw)[health] == 1)
            for i in range(2):  # round robin over two healthy replicas: one request each
                sdk.completions.create(model="slow", prompt=f"Back {i}", max_tokens=1)
            assert wait_for(lambda: engine_metrics(revived).get("vllm:prefix_cache_queries_total", 0) > 0)
    finally:
        for server in (doomed, revived):
            if server is not None:
                server.stop()
