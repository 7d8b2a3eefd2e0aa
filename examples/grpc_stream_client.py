"""Stream one answer from a running `trtserve serve` over gRPC (tritonclient.grpc).

python examples/grpc_stream_client.py --url 127.0.0.1:8001 --prompt "What is the capital of France?"
"""

from __future__ import annotations

import json
import queue
import sys

import click
import numpy as np
import tritonclient.grpc as grpcclient


def make_inputs(prompt: str, max_tokens: int, chat: bool) -> list[grpcclient.InferInput]:
    text = json.dumps([{"role": "user", "content": prompt}]) if chat else prompt
    values = {
        "messages" if chat else "text_input": np.array([text.encode()], dtype=object),
        "max_tokens": np.array([max_tokens], dtype=np.int64),
        "stream": np.array([True]),
    }
    dtypes = {np.dtype(object): "BYTES", np.dtype(np.int64): "INT64", np.dtype(bool): "BOOL"}
    inputs = []
    for name, value in values.items():
        tensor = grpcclient.InferInput(name, list(value.shape), dtypes[value.dtype])
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def stream_answer(url: str, prompt: str, max_tokens: int = 128, chat: bool = True, model: str = "llm") -> str:
    """Print the answer as it streams; return it whole."""
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(model, make_inputs(prompt, max_tokens, chat))
    answer = ""
    try:
        while True:
            result, error = responses.get(timeout=300)
            if error is not None:
                raise click.ClickException(str(error))
            delta = result.as_numpy("text_output")[0].decode()
            answer += delta
            sys.stdout.write(delta)
            sys.stdout.flush()
            if result.as_numpy("finish_reason")[0]:
                break
    finally:
        client.stop_stream()
    sys.stdout.write("\n")
    return answer


@click.command()
@click.option("--url", default="127.0.0.1:8001", show_default=True, help="Triton gRPC address.")
@click.option("--prompt", required=True)
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--chat/--no-chat", default=True, show_default=True)
def main(url: str, prompt: str, max_tokens: int, chat: bool) -> None:
    stream_answer(url, prompt, max_tokens, chat)


if __name__ == "__main__":
    main()
