"""`trtserve`: run engines built by `build-engine`."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import click

from runtime.engine_config import EngineConfig, EngineLoadError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main() -> None:
    """trtserve: compiled-engine LLM runtime (ONNX Runtime CPU today, TensorRT on GPU)."""


@main.command()
@click.option(
    "--engine",
    "engine_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Engine directory written by build-engine.",
)
@click.option("--prompt", required=True, help="The prompt text.")
@click.option(
    "--max-tokens",
    default=128,
    show_default=True,
    type=click.IntRange(min=1),
    help="Most tokens to generate.",
)
@click.option(
    "--chat/--no-chat",
    default=True,
    show_default=True,
    help="Wrap the prompt in the model's chat template as a user message.",
)
@click.option("--stats", is_flag=True, help="Print token counts and timing to stderr.")
def generate(engine_dir: Path, prompt: str, max_tokens: int, chat: bool, stats: bool) -> None:
    """Greedy-decode an answer to PROMPT and print it."""
    from transformers.utils import logging as transformers_logging

    from runtime.greedy import greedy_generate
    from runtime.ort_backend import OrtBackend
    from runtime.text import encode_prompt, load_tokenizer, stop_token_ids

    logging.basicConfig(level=logging.WARNING)
    transformers_logging.set_verbosity_error()
    try:
        config = EngineConfig.load(engine_dir)
        backend = OrtBackend(config, num_blocks=config.max_blocks_per_seq)
        tokenizer = load_tokenizer(engine_dir)
        prompt_ids = encode_prompt(tokenizer, prompt, chat)
        if not prompt.strip():
            raise ValueError("--prompt is empty")
        if len(prompt_ids) + max_tokens > config.max_seq_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + --max-tokens ({max_tokens}) exceeds the "
                f"engine's max_seq_len ({config.max_seq_len})"
            )
    except (EngineLoadError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    start = time.perf_counter()
    [output] = greedy_generate(backend, [prompt_ids], max_tokens, stop_token_ids(tokenizer, config))
    elapsed = time.perf_counter() - start
    click.echo(tokenizer.decode(output, skip_special_tokens=True).strip())
    if stats:
        print(
            f"prompt {len(prompt_ids)} tokens, generated {len(output)} tokens in {elapsed:.2f} s "
            f"({len(output) / elapsed:.1f} tok/s incl. prefill)",
            file=sys.stderr,
        )
