"""`python -m benchmarks.gateway_fake_triton`: a stand-in tritonserver for measuring the gateway alone.

It speaks the KServe gRPC calls the gateway uses (ModelReady, ModelStreamInfer) for the `llm` model's
inputs and outputs, and paces tokens like a batching engine: one global step every `--step-ms`, each step
giving every open stream its next token (" the"). Prompt tokens are counted with the engine's tokenizer, so
benchmarks.client's checks hold. No model runs: the gateway's CPU per token is measured without the engine
competing for the cores (benchmarks.gateway_profile --fake-step-ms).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import click
import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

TOKEN = b" the"
OUTPUTS = ("text_output", "finish_reason", "prompt_tokens", "completion_tokens", "logprobs")


def _bytes_tensor(value: bytes) -> bytes:
    return len(value).to_bytes(4, "little") + value


class FakeTriton(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, step_s: float, count_tokens: Any) -> None:
        self.step_s, self.count_tokens = step_s, count_tokens
        self._step: asyncio.Future[None] | None = None

    async def steps(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._step = loop.create_future()
            await asyncio.sleep(self.step_s)
            self._step.set_result(None)

    async def ModelReady(self, request: Any, context: Any) -> Any:  # the gRPC method's name
        return pb.ModelReadyResponse(ready=True)

    async def ModelStreamInfer(self, requests: Any, context: Any) -> Any:
        async for request in requests:
            raw = {t.name: r for t, r in zip(request.inputs, request.raw_input_contents, strict=True)}
            max_tokens = int.from_bytes(raw["max_tokens"][:8], "little") if "max_tokens" in raw else 16
            text = raw["text_input"][4:] if "text_input" in raw else raw["messages"][4:]
            prompt = self.count_tokens(text.decode())
            wanted = [o.name for o in request.outputs] or list(OUTPUTS)
            for i in range(1, max_tokens + 1):
                assert self._step is not None
                await asyncio.shield(self._step)
                finish = b"length" if i == max_tokens else b""
                values = {"text_output": _bytes_tensor(TOKEN), "logprobs": _bytes_tensor(b"[]"),
                          "finish_reason": _bytes_tensor(finish), "prompt_tokens": prompt.to_bytes(4, "little"),
                          "completion_tokens": i.to_bytes(4, "little")}  # fmt: skip
                response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
                for name in wanted:
                    response.outputs.add(name=name, datatype="INT32" if name.endswith("tokens") else "BYTES", shape=[1])
                    response.raw_output_contents.append(values[name])
                yield pb.ModelStreamInferResponse(infer_response=response)


async def serve(port: int, step_s: float, engine: Path, counts_path: Path | None) -> None:
    from runtime.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(engine)
    known: dict[str, int] = json.loads(counts_path.read_text()) if counts_path else {}

    def count(text: str) -> int:  # the harness's prompts are counted in advance: no tokenizing on the clock
        return known[text] if text in known else len(tokenizer.encode(text, add_special_tokens=False))

    fake = FakeTriton(step_s, count)
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(fake, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stepper = asyncio.create_task(fake.steps())
    print(json.dumps({"listening": port}), flush=True)
    try:
        await server.wait_for_termination()
    finally:
        stepper.cancel()


@click.command()
@click.option("--port", type=int, required=True)
@click.option("--step-ms", type=float, default=20.0, show_default=True)
@click.option("--engine", type=click.Path(exists=True, path_type=Path), required=True, help="For its tokenizer.")
@click.option("--prompt-counts", type=click.Path(exists=True, path_type=Path), help="JSON: prompt -> its tokens.")
def main(port: int, step_ms: float, engine: Path, prompt_counts: Path | None) -> None:
    asyncio.run(serve(port, step_ms / 1000, engine, prompt_counts))


if __name__ == "__main__":
    main()
