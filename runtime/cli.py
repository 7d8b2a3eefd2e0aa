"""`trtserve`: run engines built by `build-engine`."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import click

from runtime.engine_config import EngineLoadError
from runtime.errors import InvalidRequest


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
    help="Send the prompt as a user message through the model's chat template.",
)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int, help="0 = off.")
@click.option("--seed", default=None, type=int, help="Makes sampling reproducible.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); not included in the output.")
@click.option("--stats", is_flag=True, help="Print token counts and timing to stderr.")
def generate(engine_dir: Path, prompt: str, max_tokens: int, chat: bool, temperature: float, top_p: float,
             top_k: int, seed: int | None, stop: tuple[str, ...], stats: bool) -> None:  # fmt: skip
    """Generate an answer to --prompt and stream it to stdout."""
    from transformers.utils import logging as transformers_logging

    from runtime.llm_engine import LLMEngine
    from runtime.sampling_params import SamplingParams

    logging.basicConfig(level=logging.WARNING)
    transformers_logging.set_verbosity_error()
    try:
        if not prompt.strip():
            raise InvalidRequest("--prompt", "must not be empty")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=stop)  # fmt: skip
        engine = LLMEngine(engine_dir)
        engine.add_request([{"role": "user", "content": prompt}] if chat else prompt, params)
    except (EngineLoadError, InvalidRequest) as exc:
        raise click.ClickException(str(exc)) from None
    start, final = time.perf_counter(), None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            click.echo(delta.text, nl=False)
            final = delta if delta.finished else final
    click.echo()
    if stats and final is not None:
        elapsed = time.perf_counter() - start
        s = final.stats
        print(
            f"prompt {final.num_prompt_tokens} tokens, generated {final.num_output_tokens} "
            f"({final.finish_reason}) in {elapsed:.2f} s; TTFT {1000 * s['ttft_s']:.0f} ms, "
            f"{(final.num_output_tokens - 1) / max(s['e2e_s'] - s['ttft_s'], 1e-9):.1f} tok/s decode",
            file=sys.stderr,
        )
