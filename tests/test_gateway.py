"""The OpenAI gateway through the official `openai` SDK, against a live gateway + tritonserver
serving the tiny Llama engine: answers equal the offline engine's (an independent path to the
same engine), streaming, usage, stop, n, seeds, logprobs, trtserve's extra body fields,
OpenAI-shaped errors, and routing (virtual models over two backend names for the one server).
One tritonserver and one gateway (configured by a YAML file) for the module.

Limits (401, 429), client cancellation and 503 need a slower engine: tests/test_gateway_limits.py.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import yaml

from runtime import LLM, SamplingParams
from tests.gateway_helpers import client, gateway_metrics, running_gateway
from tests.triton_helpers import running_server

pytestmark = pytest.mark.serving
MODEL = "tiny"
STRONG = "tiny-strong"  # the same tritonserver under a second backend name: routing shows in `model`
HI = [{"role": "user", "content": "Hi there"}]
CASCADE_PROMPT = "Paged attention"


@pytest.fixture(scope="module")
def triton(llama_engine):
    with running_server(llama_engine) as server:
        yield server


@pytest.fixture(scope="module")
def engine(llama_engine) -> LLM:
    return LLM(llama_engine)


@pytest.fixture(scope="module")
def small_confidence(engine) -> float:
    """The mean token logprob of the small model's greedy answer to CASCADE_PROMPT (8 tokens)."""
    logprobs = reference(engine, CASCADE_PROMPT, max_tokens=8, logprobs=0).logprobs
    return sum(lp.logprob for lp in logprobs) / len(logprobs)


@pytest.fixture(scope="module")
def gateway(triton, small_confidence, tmp_path_factory):
    url = f"127.0.0.1:{triton.config.grpc_port}"
    config = {
        "backends": {MODEL: {"url": url}, STRONG: {"url": url}},
        "virtual_models": {
            # Thresholds just above / below the small answer's confidence: escalates / keeps it.
            "cascade-escalates": {"policy": "cascade", "small": MODEL, "strong": STRONG,
                                  "cascade_threshold": small_confidence + 0.05},
            "cascade-keeps": {"policy": "cascade", "small": MODEL, "strong": STRONG,
                              "cascade_threshold": small_confidence - 0.05},
            "by-length": {"policy": "prompt_length", "small": MODEL, "strong": STRONG, "max_small_prompt_chars": 20},
        },
    }  # fmt: skip
    path = tmp_path_factory.mktemp("gateway") / "gateway.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with running_gateway(None, None, "--config", str(path)) as gw:
        yield gw


@pytest.fixture(scope="module")
def sdk(gateway) -> openai.OpenAI:
    return client(gateway.url)


def reference(engine: LLM, prompt, **params):
    """The offline engine's completion; greedy unless told otherwise."""
    return engine.generate([prompt], SamplingParams(**{"temperature": 0.0, **params}))[0]


def test_models(sdk):
    assert [m.id for m in sdk.models.list()] == [MODEL, STRONG, "cascade-escalates", "cascade-keeps", "by-length"]
    assert sdk.models.retrieve(MODEL).owned_by == "trtserve"
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")


def test_chat_equals_the_offline_engine_with_engine_usage(sdk, engine):
    want = reference(engine, HI, max_tokens=6)
    reply = sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0)
    assert reply.model == MODEL and reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    [choice] = reply.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason and choice.logprobs is None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(want.prompt_token_ids),
                                                                          len(want.token_ids))  # fmt: skip
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_max_completion_tokens_and_system_messages(sdk, engine):
    messages = [{"role": "developer", "content": "Be brief."}, *HI]
    want = reference(engine, [{"role": "system", "content": "Be brief."}, *HI], max_tokens=5)
    reply = sdk.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5, temperature=0)
    assert reply.choices[0].message.content == want.text and reply.usage.completion_tokens == len(want.token_ids)


def test_chat_stream_with_usage_chunk(sdk, engine):
    want = reference(engine, HI, max_tokens=16, ignore_eos=True)
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=16, temperature=0,
                                              extra_body={"ignore_eos": True}, stream=True,
                                              stream_options={"include_usage": True}))  # fmt: skip
    *content, last = chunks
    # A chunk per token, or fewer, longer ones where the stream fell behind the engine core (its process runs ahead).
    assert 1 <= len(content) <= 16
    assert content[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in content[1:])
    assert "".join(c.choices[0].delta.content for c in content) == want.text
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert all(c.usage is None for c in content)
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        len(want.prompt_token_ids), 16)  # fmt: skip
    assert len({c.id for c in chunks}) == 1


def test_raw_stream_is_sse_ending_in_done(gateway):
    body = {"model": MODEL, "prompt": "The quick brown", "max_tokens": 4, "stream": True}
    request = urllib.request.Request(f"{gateway.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in response.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_completions_several_prompts_and_stream(sdk, engine):
    prompts = ["Paged attention", "The quick brown"]
    wants = [reference(engine, p, max_tokens=12) for p in prompts]
    reply = sdk.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert [c.text for c in reply.choices] == [w.text for w in wants]
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in wants)
    assert reply.usage.completion_tokens == sum(len(w.token_ids) for w in wants)
    streamed = sdk.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == wants[0].text


def test_completions_default_to_16_tokens_like_openai(sdk):
    reply = sdk.completions.create(model=MODEL, prompt="Paged attention", temperature=0,
                                   extra_body={"ignore_eos": True})  # fmt: skip
    assert reply.usage.completion_tokens == 16


def test_stop_strings(sdk, engine):
    free = reference(engine, "The quick brown", max_tokens=24).text
    stop = next(free[i : i + 2] for i in range(4, len(free) - 2) if free[i : i + 2].isalpha())
    want = reference(engine, "The quick brown", max_tokens=24, stop=(stop, "never-there"))
    assert want.finish_reason == "stop" and want.text == free[: free.index(stop)]
    reply = sdk.completions.create(model=MODEL, prompt="The quick brown", max_tokens=24, temperature=0,
                                   stop=[stop, "never-there"])  # fmt: skip
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (want.text, "stop")
    single = sdk.completions.create(model=MODEL, prompt="The quick brown", max_tokens=24, temperature=0, stop=stop)
    assert single.choices[0].text == want.text


def test_n_choices_sample_with_consecutive_seeds(sdk, engine):
    """Choice j samples with seed + j: reproducible as a whole, distinct choice by choice."""
    wants = [reference(engine, HI, temperature=1.0, seed=7 + j, max_tokens=12).text for j in range(3)]
    assert len(set(wants)) == 3  # the check below can tell the choices apart
    reply = sdk.chat.completions.create(model=MODEL, messages=HI, n=3, seed=7, temperature=1.0, max_tokens=12)
    assert [c.message.content for c in reply.choices] == wants
    assert [c.index for c in reply.choices] == [0, 1, 2]
    again = sdk.chat.completions.create(model=MODEL, messages=HI, n=3, seed=7, temperature=1.0, max_tokens=12)
    assert [c.message.content for c in again.choices] == wants
    streamed = sdk.chat.completions.create(model=MODEL, messages=HI, n=3, seed=7, temperature=1.0, max_tokens=12,
                                           stream=True)  # fmt: skip
    texts = ["", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == wants


def test_chat_logprobs_equal_the_engine(sdk, engine):
    want = reference(engine, HI, max_tokens=5, logprobs=2)
    reply = sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, temperature=0, logprobs=True,
                                        top_logprobs=2)  # fmt: skip
    content = reply.choices[0].logprobs.content
    assert "".join(c.token for c in content) == want.text  # each token's own text (tests/test_hardening_inputs.py)
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in want.logprobs], rel=1e-5)
    for got, lp in zip(content, want.logprobs, strict=True):
        assert got.top_logprobs[0].token == got.token  # greedy: the sampled token is the best alternative
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([v for _, v in lp.top], rel=1e-5)


def test_completion_logprobs_format(sdk, engine):
    want = reference(engine, "Paged attention", max_tokens=4, logprobs=1)
    reply = sdk.completions.create(model=MODEL, prompt="Paged attention", max_tokens=4, temperature=0, logprobs=1)
    logprobs = reply.choices[0].logprobs
    assert "".join(logprobs.tokens) == want.text and len(logprobs.tokens) == len(want.token_ids)
    assert logprobs.token_logprobs == pytest.approx([lp.logprob for lp in want.logprobs], rel=1e-5)
    assert [list(top) for top in logprobs.top_logprobs] == [[t] for t in logprobs.tokens]  # greedy: top-1 sampled
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]


def test_echo_scores_the_prompt_as_the_engine_does(sdk, engine):
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1): the prompt, then the completion; the
    prompt's tokens carry the engine's prompt_logprobs (the first null), then the generated token's."""
    prompt = "Paged attention keeps the cache"
    want = reference(engine, prompt, max_tokens=1, logprobs=1, prompt_logprobs=1)
    reply = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    choice = reply.choices[0]
    assert choice.text == prompt + want.text
    logprobs = choice.logprobs
    scored = want.prompt_logprobs[1:] + want.logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx([lp.logprob for lp in scored], rel=1e-5)
    assert [list(top.values()) for top in logprobs.top_logprobs[1:]] == [
        pytest.approx([v for _, v in lp.top], rel=1e-5) for lp in scored
    ]
    assert "".join(logprobs.tokens) == choice.text and len(logprobs.tokens) == reply.usage.prompt_tokens + 1
    # max_tokens 0: the prompt scored, nothing generated
    scores = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, logprobs=1, echo=True)
    assert scores.choices[0].text == prompt and scores.usage.completion_tokens == 0
    assert scores.choices[0].logprobs.token_logprobs == logprobs.token_logprobs[:-1]
    # echo without logprobs: the text only
    plain = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True)
    assert plain.choices[0].text == prompt + want.text and plain.choices[0].logprobs is None


def test_vllm_prompt_logprobs_field_on_both_endpoints(gateway, engine):
    want = reference(engine, "Paged attention", max_tokens=2, prompt_logprobs=2)
    body = {"model": MODEL, "prompt": "Paged attention", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    got = post(gateway.url + "/v1/completions", body)["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_logprobs)
    for entry, lp in zip(got[1:], want.prompt_logprobs[1:], strict=True):
        assert entry[str(lp.token_id)]["logprob"] == pytest.approx(lp.logprob, rel=1e-5)
        ranked = sorted((v["rank"], int(k), v["logprob"]) for k, v in entry.items() if v["rank"] is not None)
        assert [(t, pytest.approx(v, rel=1e-5)) for _, t, v in ranked] == lp.top
    chat = {"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}
    reply = post(gateway.url + "/v1/chat/completions", chat)
    assert reply["prompt_logprobs"][0] is None and len(reply["prompt_logprobs"]) == reply["usage"]["prompt_tokens"]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@pytest.mark.parametrize(
    ("kwargs", "param", "says"),
    [
        ({"echo": True, "stream": True}, "echo", "not supported with 'stream'"),
        ({"echo": True, "n": 2}, "echo", "'n' above 1"),
        ({"max_tokens": 0}, "max_tokens", "0 only with 'echo'"),
        ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs", "less than or equal to 20"),
        ({"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs", "not supported with 'stream'"),
    ],
)
def test_bad_completions_are_400s_naming_the_parameter(sdk, kwargs, param, says):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.completions.create(**{"model": MODEL, "prompt": "Hi", "max_tokens": 2, **kwargs})
    assert caught.value.status_code == 400 and caught.value.param == param and says in caught.value.message


def test_logit_bias_bans_and_forces_as_in_the_engine(sdk, engine):
    plain = reference(engine, "Paged attention", max_tokens=4, ignore_eos=True)
    bias = {str(t): -100 for t in plain.token_ids}
    want = reference(engine, "Paged attention", max_tokens=4, ignore_eos=True, logit_bias=bias)
    reply = sdk.completions.create(
        model=MODEL,
        prompt="Paged attention",
        max_tokens=4,
        temperature=0,
        logit_bias=bias,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].text == want.text != plain.text
    forced = sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0, logit_bias={"77": 100})
    assert forced.choices[0].message.content == engine.tokenizer.decode([77] * 3)


def test_trtserve_extra_body_fields(sdk, engine):
    """top_k, min_p, repetition_penalty, ignore_eos and priority pass through; with the penalties
    (exact in float32) the answer differs from plain greedy, so they really reached the engine."""
    extras = {"top_k": 1, "min_p": 0.5, "repetition_penalty": 1.25, "ignore_eos": True, "priority": 1}
    params = dict(temperature=1.0, seed=3, max_tokens=20, presence_penalty=0.5, frequency_penalty=0.25)
    want = reference(engine, "Paged attention", **params, **extras)
    assert want.text != reference(engine, "Paged attention", max_tokens=20, ignore_eos=True).text
    reply = sdk.completions.create(model=MODEL, prompt="Paged attention", **params, extra_body=extras)
    assert reply.choices[0].text == want.text
    assert (reply.usage.completion_tokens, reply.choices[0].finish_reason) == (20, "length")


@pytest.mark.parametrize(
    ("kwargs", "param", "says"),
    [
        ({"max_tokens": "many"}, "max_tokens", "valid integer"),  # wrong JSON type
        ({"temperature": "hot"}, "temperature", "valid number"),
        ({"stream": "yes"}, "stream", "valid boolean"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
            "response_format.json_schema.schema",
            "Invalid type: objec",
        ),  # checked before any work
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"logit_bias": {"999999": 1}}, "logit_bias", "outside the vocabulary"),  # (the engine's check)
        ({"logit_bias": {"5": 101}}, "logit_bias", "must be in [-100, 100]"),
        ({"functions": [{"name": "f"}]}, "functions", "not supported"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate", "unknown parameter"),
        ({"extra_body": {"top_k": -1}}, "top_k", "greater than or equal to 0"),
        ({"messages": []}, "messages", "at least 1 item"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'user'"),
        ({"top_logprobs": 2}, "top_logprobs", "needs 'logprobs'"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when 'stream'"),
        # Checked by the engine, not the gateway: still a 400 naming the parameter.
        ({"messages": [{"role": "user", "content": "word " * 300}]}, "messages", "max sequence length"),
        ({"extra_body": {"ttft_target_s": 0}}, "ttft_target_s", "greater than 0"),
        ({"extra_body": {"cache_salt": ""}}, "cache_salt", "at least 1 character"),
        ({"stop": ["x" * 257]}, "stop[0]", "at most 256 characters"),
    ],
)
def test_bad_requests_are_400s_naming_the_parameter(sdk, kwargs, param, says):
    args = {"model": MODEL, "messages": HI, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(**args)
    error = caught.value
    assert error.status_code == 400 and error.param == param and error.type == "invalid_request_error"
    assert says in error.message
    assert sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).usage.completion_tokens >= 1


def test_unknown_model_is_404(sdk):
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.chat.completions.create(model="gpt-4o", messages=HI)
    assert caught.value.code == "model_not_found" and caught.value.param == "model"


@pytest.mark.parametrize(("path", "data", "status"), [("/v1/completions", b"{not json", 400),
                                                      ("/v1/completions", b"[1, 2]", 400),
                                                      ("/v1/nothing-here", b"{}", 404)])  # fmt: skip
def test_malformed_bodies_and_paths_get_openai_error_shape(gateway, path, data, status):
    request = urllib.request.Request(f"{gateway.url}{path}", data=data, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == status
    error = json.loads(caught.value.read())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_health_and_metrics_count_requests_and_engine_tokens(gateway, sdk):
    with urllib.request.urlopen(f"{gateway.url}/health", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok", "healthy_backends": [MODEL, STRONG]}
    ok = f'trtserve_gateway_requests_total{{endpoint="/v1/completions",model="{MODEL}",status="200"}}'
    bad = 'trtserve_gateway_requests_total{endpoint="/v1/completions",model="-",status="400"}'  # invalid body
    tokens = f'trtserve_gateway_tokens_total{{kind="completion",model="{MODEL}"}}'
    before = gateway_metrics(gateway)
    reply = sdk.completions.create(model=MODEL, prompt="count me", max_tokens=5, temperature=0)
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model=MODEL, prompt="count me", max_tokens=0)
    after = gateway_metrics(gateway)
    assert after[ok] - before.get(ok, 0) == 1 and after[bad] - before.get(bad, 0) == 1
    assert after[tokens] - before.get(tokens, 0) == reply.usage.completion_tokens
    assert after[f'trtserve_gateway_backend_healthy{{backend="{MODEL}"}}'] == 1


@pytest.mark.parametrize(("virtual", "answers"), [("cascade-escalates", STRONG), ("cascade-keeps", MODEL)])
def test_cascade_re_answers_with_the_strong_model_below_the_threshold(gateway, sdk, engine, virtual, answers):
    want = reference(engine, CASCADE_PROMPT, max_tokens=8)
    reason = "escalated" if answers == STRONG else "cascade"
    labels = f'model="{answers}",reason="{reason}",virtual_model="{virtual}"'
    decisions = f"trtserve_gateway_route_decisions_total{{{labels}}}"
    small_tokens = f'trtserve_gateway_tokens_total{{kind="completion",model="{MODEL}"}}'
    before = gateway_metrics(gateway)
    reply = sdk.completions.create(model=virtual, prompt=CASCADE_PROMPT, max_tokens=8, temperature=0)
    assert reply.model == answers and reply.choices[0].text == want.text
    assert reply.choices[0].logprobs is None  # asked upstream for the decision, not by the client
    after = gateway_metrics(gateway)
    assert after[decisions] == before.get(decisions, 0) + 1
    # The small model's answer counts even when it is thrown away (it cost engine time).
    assert after[small_tokens] - before.get(small_tokens, 0) == len(want.token_ids)


def test_streaming_cascade_is_routed_by_prompt_length(sdk):
    """A streamed answer cannot be taken back, so a cascade streams from the length-chosen model."""
    stream = sdk.completions.create(model="cascade-escalates", prompt=CASCADE_PROMPT, max_tokens=4, stream=True)
    assert {chunk.model for chunk in stream} == {MODEL}  # short prompt (default limit 2000 chars)


@pytest.mark.parametrize(("prompt", "answers"), [("short one", MODEL), ("a prompt over twenty chars", STRONG)])
def test_prompt_length_routing(sdk, prompt, answers):
    reply = sdk.chat.completions.create(model="by-length", messages=[{"role": "user", "content": prompt}],
                                        max_tokens=2)  # fmt: skip
    assert reply.model == answers


def status_and_body(url: str, body: dict) -> tuple[int, dict]:
    try:
        return 200, post(url, body)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_tokenize_and_detokenize_are_the_engines(gateway, engine):
    tokenizer = engine.tokenizer
    want = tokenizer.encode("Paged attention")
    got = post(gateway.url + "/tokenize", {"model": MODEL, "prompt": "Paged attention"})
    assert got == {"count": len(want), "max_model_len": engine.engine.context_tokens, "tokens": want}
    chat = post(gateway.url + "/tokenize", {"model": MODEL, "messages": HI})
    assert chat["tokens"] == engine.engine.tokenize(HI)  # the chat template with its generation prompt, as served
    back = post(gateway.url + "/detokenize", {"model": MODEL, "tokens": want})
    assert back == {"prompt": tokenizer.decode(want, skip_special_tokens=False)}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": MODEL, "prompt": "hi", "messages": HI}, 400, "prompt"),
        ("/tokenize", {"model": MODEL}, 400, "prompt"),
        ("/tokenize", {"model": "nope", "prompt": "hi"}, 404, "model"),
        ("/detokenize", {"model": MODEL, "tokens": [999999]}, 400, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": []}, 400, "tokens"),
    ],
)
def test_bad_tokenizer_requests_name_the_field(gateway, path, body, status, param):
    got_status, got = status_and_body(gateway.url + path, body)
    assert (got_status, got["error"]["param"]) == (status, param)


def test_token_id_prompts_complete_as_the_engine(sdk, engine):
    ids = engine.tokenizer.encode("Paged attention")
    want = reference(engine, ids, max_tokens=4)
    reply = sdk.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert reply.choices[0].text == want.text and reply.usage.prompt_tokens == len(ids)
    two = sdk.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=2, temperature=0)
    assert [c.text for c in two.choices] == [reference(engine, p, max_tokens=2).text for p in (ids, ids[:2])]
    echoed = sdk.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=0)
    prompt = engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert echoed.choices[0].text == prompt + reference(engine, ids, max_tokens=1).text
    assert len(echoed.choices[0].logprobs.token_logprobs) == len(ids) + 1
