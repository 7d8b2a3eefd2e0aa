"""Stream a chat answer from a running `trtserve serve` through the official openai SDK.

python examples/openai_client.py "What is the capital of France?" [--url http://127.0.0.1:9000/v1]
"""

from __future__ import annotations

import os

import click
from openai import OpenAI


@click.command()
@click.argument("prompt", default="What is the capital of France?")
@click.option("--url", default="http://127.0.0.1:9000/v1", show_default=True, help="The OpenAI endpoint.")
@click.option("--max-tokens", default=64, show_default=True)
def main(prompt: str, url: str, max_tokens: int) -> None:
    client = OpenAI(base_url=url, api_key=os.environ.get("TRTSERVE_API_KEY", "unused"))
    model = client.models.list().data[0].id  # `trtserve serve` serves one model
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices:
            click.echo(chunk.choices[0].delta.content or "", nl=False)
        elif chunk.usage:
            click.echo(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]",
                       err=True)  # fmt: skip


if __name__ == "__main__":
    main()
