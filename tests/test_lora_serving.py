"""Multi-LoRA served as users run it: two tritonservers with `lora_modules`, the gateway in front, the openai SDK
naming adapters as models, adapters loaded and unloaded at run time with an admin key, Triton clients naming an
adapter in the `lora` input; each answer against HF eager + PEFT."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from builder.sources import load_checkpoint, resolve_model
from tests.gateway_helpers import client, running_gateway, running_servers
from tests.helpers import hf_greedy, make_lora_adapter, random_prompts, with_lora
from tests.triton_helpers import metrics, sse_events, wait_for

pytestmark = pytest.mark.serving
MODEL, KEY = "tiny", "lora-admin-key"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(resolve_model("tiny-llama"))


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory) -> dict[str, Path]:
    model, _ = checkpoint
    root = tmp_path_factory.mktemp("served-loras")
    other = load_checkpoint(resolve_model("tiny-qwen2"))[0]
    return {
        "qv": make_lora_adapter(model, root / "qv", ["q_proj", "v_proj"], 8, 16, 1),
        "qkvo": make_lora_adapter(model, root / "qkvo", ["q_proj", "k_proj", "v_proj", "o_proj"], 16, 8, 2),
        "later": make_lora_adapter(model, root / "later", ["v_proj", "o_proj"], 8, 32, 3),
        "big": make_lora_adapter(model, root / "big", ["q_proj"], 64, 64, 4),
        "qwen": make_lora_adapter(other, root / "qwen", ["q_proj", "v_proj"], 8, 16, 5),  # v: other shapes
    }


def post(url: str, body: dict, key: str | None = KEY) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_adapters_through_the_openai_door_and_triton(llama_engine, checkpoint, adapters):
    model, tokenizer = checkpoint
    params = {
        "backend": "cpu",
        "lora_modules": f"qv={adapters['qv']},qkvo={adapters['qkvo']}",
        "max_loras": "2",
        "max_lora_rank": "32",
    }
    prompts = random_prompts(model.config.vocab_size, [9, 14, 21, 6, 17, 11], seed=2)

    def expected(adapter: str | None, prompt: list[int]) -> str:
        ids = hf_greedy(with_lora(model, adapters.get(adapter or "")), prompt, NEW_TOKENS, (10**9,))
        return tokenizer.decode(ids, skip_special_tokens=True)

    with running_servers(llama_engine, 2, params) as servers:
        urls = [arg for s in servers for arg in ("--triton-url", f"127.0.0.1:{s.config.grpc_port}")]
        with running_gateway(None, None, *urls, "--model", MODEL, api_key=KEY) as gateway:
            sdk = client(gateway.url, KEY)
            listed = {m.id: m.model_dump() for m in sdk.models.list().data}
            assert listed[MODEL]["parent"] is None
            assert {k: listed[k]["parent"] for k in ("qv", "qkvo")} == {"qv": MODEL, "qkvo": MODEL}
            assert listed["qv"]["root"] == str(adapters["qv"].resolve())

            def complete(name: str, prompt: list[int]) -> str:
                answer = sdk.completions.create(
                    model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
                )
                assert answer.model == name
                return answer.choices[0].text

            names = [MODEL, "qv", "qkvo", "qv", MODEL, "qkvo"]
            with concurrent.futures.ThreadPoolExecutor(6) as pool:  # mixed batches on both replicas
                got = list(pool.map(complete, names, prompts))
            for name, prompt, text in zip(names, prompts, got, strict=True):
                assert text == expected(None if name == MODEL else name, prompt), name

            with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
                complete("nope", prompts[0])

            # At run time, with an admin key: on every replica, or refused with the reason.
            load, unload = f"{gateway.url}/v1/load_lora_adapter", f"{gateway.url}/v1/unload_lora_adapter"
            status, text = post(load, {"lora_name": "later", "lora_path": str(adapters["later"])}, key=None)
            assert status == 401, text
            status, text = post(load, {"lora_name": "qwen", "lora_path": str(adapters["qwen"])})
            assert status == 400 and "another base model" in text and '"param":"lora_path"' in text, text
            status, text = post(load, {"lora_name": "big", "lora_path": str(adapters["big"])})
            assert status == 400 and "rank 64 is above the server's max_lora_rank 32" in text, text
            status, text = post(load, {"lora_name": "later", "lora_path": str(adapters["later"])})
            assert status == 200 and "Success" in text, text
            for prompt in prompts[:4]:  # either replica
                assert complete("later", prompt) == expected("later", prompt)
            assert post(load, {"lora_name": "later", "lora_path": str(adapters["later"])})[0] == 400  # loaded
            status, text = post(unload, {"lora_name": "later"})
            assert status == 200, text
            with pytest.raises(openai.NotFoundError, match="'later' does not exist"):
                complete("later", prompts[0])
            assert post(unload, {"lora_name": "later"})[0] == 404

        # Triton clients name the adapter in the `lora` input.
        body = {"input_ids": prompts[1], "lora": "qkvo", "max_tokens": NEW_TOKENS, "ignore_eos": True, "stream": True}
        assert "".join(e["text_output"] for e in sse_events(servers[0], body)) == expected("qkvo", prompts[1])

        def counted() -> bool:
            series = metrics(servers[0]).items()
            return any(k.startswith("trtserve_lora_requests_total{") and 'adapter="qkvo"' in k for k, _ in series)

        assert wait_for(counted), metrics(servers[0])
