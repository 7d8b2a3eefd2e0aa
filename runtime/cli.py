"""`trtserve`: run engines built by `build-engine`."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import click

from engine_format import EngineLoadError
from runtime.cli_options import engine_options
from runtime.cli_serve import serve
from runtime.engine.engine_args import EngineArgs
from runtime.engine.errors import InvalidRequest
from runtime.gateway.cli import gateway as gateway_command

COMMAND_ENTRY_POINTS = "trtserve.commands"


class _Commands(click.Group):
    """trtserve's own commands plus those other packages register under the `trtserve.commands`
    entry-point group (pyproject.toml): `calibrate` (builder + calibration) and `kernels`
    (plugins_cuda). They load when used, so the runtime imports neither package."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *_registered_commands()})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is None and (entry := _registered_commands().get(name)):
            command = entry.load()
        return command


def _registered_commands() -> dict[str, EntryPoint]:
    return {e.name: e for e in entry_points(group=COMMAND_ENTRY_POINTS)}


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main() -> None:
    """trtserve: compiled-engine LLM runtime (ONNX Runtime CPU today, TensorRT on GPU)."""


main.add_command(gateway_command)


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
@engine_options([f for f in dataclasses.fields(EngineArgs) if f.name != "engine_process"])  # (AsyncLLM's)
def generate(engine_dir: Path, prompt: str, max_tokens: int, chat: bool, temperature: float, top_p: float,
             top_k: int, seed: int | None, stop: tuple[str, ...], stats: bool,
             engine_args: EngineArgs) -> None:  # fmt: skip
    """Generate an answer to --prompt and stream it to stdout."""
    from transformers.utils import logging as transformers_logging

    from executors.sampling import SamplingParams
    from runtime.engine.llm_engine import LLMEngine

    logging.basicConfig(level=logging.WARNING)
    transformers_logging.set_verbosity_error()
    try:
        if not prompt.strip():
            raise InvalidRequest("--prompt", "must not be empty")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=stop)  # fmt: skip
        engine = LLMEngine(engine_dir, engine_args)
        engine.add_request([{"role": "user", "content": prompt}] if chat else prompt, params)
    except (EngineLoadError, InvalidRequest, ValueError) as exc:
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
        ttft, e2e = (s["ttft_s"], s["e2e_s"]) if s is not None else (None, None)
        timing = (
            f"; TTFT {1000 * ttft:.0f} ms, {(final.num_output_tokens - 1) / max(e2e - ttft, 1e-9):.1f} tok/s decode"
            if ttft is not None and e2e is not None
            else ""  # no token came (the request failed first)
        )
        print(
            f"prompt {final.num_prompt_tokens} tokens, generated {final.num_output_tokens} "
            f"({final.finish_reason}) in {elapsed:.2f} s{timing}",
            file=sys.stderr,
        )
        spec = engine.stats().spec_decode
        if spec is not None:
            print(
                f"speculative: {spec.drafts} verify passes, {spec.draft_tokens} drafts, {spec.accepted_tokens} "
                f"accepted ({100 * spec.acceptance_rate:.0f}%), {spec.mean_acceptance_length:.2f} tokens per pass; "
                f"accepted per position {list(spec.accepted_per_position)}",
                file=sys.stderr,
            )


main.add_command(serve)
