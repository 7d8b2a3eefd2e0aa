"""`python -m benchmarks.grammar_engines`: xgrammar against llguidance on this machine, to pick the grammar
engine behind structured output (executors/sampling/grammar.py uses the winner).

What the engine pays for each: a first import; per tokenizer, the vocabulary's preprocessing (once per engine);
per distinct grammar, a compile (the time-to-first-token of a request with a new schema); per generated token of
a constrained request, filling the next-token bitmask and advancing the matcher (serial with the engine's step:
at 16 constrained streams, 16 of each per step); per speculative verify, a rollback.

Each engine compiles the same JSON schemas (tests/data/structured_schemas.json) with its cache off, then walks
each grammar for `--tokens` tokens, choosing uniformly among the allowed tokens with a seeded generator (both
engines see the same kind of walk, not the same tokens: their JSON layouts differ by a space), timing each mask
fill and each advance; then rolls 3 tokens back. Medians and p99s over all schemas' tokens.

    python -m benchmarks.grammar_engines --engine /tmp/eng/smollm2 [--tokens 48] [--output grammar_engines]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np

from benchmarks.report import write_report

SCHEMAS = Path(__file__).parent.parent / "tests" / "data" / "structured_schemas.json"
ENGINES = ("xgrammar", "llguidance")


def import_seconds(module: str) -> float:
    """A cold import in a fresh interpreter (what a process that serves its first grammar pays)."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    return float(subprocess.check_output([sys.executable, "-c", code], text=True).strip().splitlines()[-1])


class Adapter:
    """One grammar engine behind the calls the benchmark times."""

    def __init__(self, name: str, tokenizer: Any, vocab_size: int) -> None:
        self.name, self.vocab_size = name, vocab_size
        start = time.perf_counter()
        if name == "xgrammar":
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        else:
            import llguidance
            import llguidance.hf
            import llguidance.numpy

            self._llg = llguidance
            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
            self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
        self.setup_s = time.perf_counter() - start

    def compile(self, schema: dict) -> Any:
        text = json.dumps(schema)
        if self.name == "xgrammar":
            return self._compiler.compile_json_schema(text, any_whitespace=False)
        grammar = self._llg.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        self._llg.LLMatcher(self._tokenizer, grammar)  # llguidance compiles lazily: its first matcher does the work
        return grammar

    def matcher(self, compiled: Any) -> Any:
        if self.name == "xgrammar":
            import xgrammar as xgr

            return xgr.GrammarMatcher(compiled, max_rollback_tokens=16)
        return self._llg.LLMatcher(self._tokenizer, compiled)

    def fill(self, matcher: Any) -> np.ndarray:
        if self.name == "xgrammar":
            matcher.fill_next_token_bitmask(self._bitmask)
            return self._bitmask.numpy()[0]
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(matcher, self._bitmask, 0)
        return self._bitmask[0]

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token) if self.name == "xgrammar" else matcher.consume_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated() if self.name == "xgrammar" else matcher.is_stopped())


def allowed_ids(words: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def walk(adapter: Adapter, schemas: list[dict], tokens: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    compile_s, matcher_s, fill_s, accept_s, rollback_s = [], [], [], [], []
    for schema in schemas:
        start = time.perf_counter()
        compiled = adapter.compile(schema)
        compile_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        matcher = adapter.matcher(compiled)
        matcher_s.append(time.perf_counter() - start)
        for _ in range(tokens):
            if adapter.done(matcher):
                break
            start = time.perf_counter()
            words = adapter.fill(matcher)
            fill_s.append(time.perf_counter() - start)
            token = int(rng.choice(allowed_ids(words, adapter.vocab_size)))
            start = time.perf_counter()
            assert adapter.accept(matcher, token), f"{adapter.name} refused a token its own mask allowed"
            accept_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        matcher.rollback(3)
        rollback_s.append(time.perf_counter() - start)
    return {
        "compile_ms": summary(compile_s, 1e3),
        "matcher_ms": summary(matcher_s, 1e3),
        "mask_us": summary(fill_s, 1e6),
        "advance_us": summary(accept_s, 1e6),
        "rollback_us": summary(rollback_s, 1e6),
        "tokens": len(fill_s),
    }


def summary(values: list[float], scale: float) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"median": round(statistics.median(values) * scale, 2), "mean": round(statistics.mean(values) * scale, 2),
            "p99": round(p99 * scale, 2), "max": round(max(values) * scale, 2)}  # fmt: skip


def tokenizers(engine_dir: Path | None) -> dict[str, tuple[Any, int]]:
    from builder.tiny import make_tokenizer

    out: dict[str, tuple[Any, int]] = {"tiny (builder/tiny.py)": (make_tokenizer(), 0)}
    if engine_dir is not None:
        from engine_format import EngineConfig
        from runtime.engine.tokenizer import load_tokenizer

        out[engine_dir.name] = (load_tokenizer(engine_dir), EngineConfig.load(engine_dir).model.vocab_size)
    return {name: (tok, vocab or len(tok)) for name, (tok, vocab) in out.items()}


@click.command()
@click.option("--engine", "engine_dir", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help="An engine directory whose tokenizer to measure too (e.g. SmolLM2's).")  # fmt: skip
@click.option("--tokens", default=48, show_default=True, type=click.IntRange(1))
@click.option("--seed", default=0, show_default=True)
@click.option("--output", default="grammar_engines", show_default=True, help="Report name under benchmarks/results/.")
def main(engine_dir: Path | None, tokens: int, seed: int, output: str) -> None:
    schemas = [entry["schema"] for entry in json.loads(SCHEMAS.read_text())]
    rows = []
    imports = {name: round(import_seconds(name), 3) for name in ENGINES}
    for tok_name, (tokenizer, vocab) in tokenizers(engine_dir).items():
        for name in ENGINES:
            adapter = Adapter(name, tokenizer, vocab)
            row = {"engine": name, "tokenizer": tok_name, "vocab": vocab, "setup_s": round(adapter.setup_s, 3),
                   **walk(adapter, schemas, tokens, seed)}  # fmt: skip
            rows.append(row)
            click.echo(f"{tok_name:>24} {name:>10}: setup {row['setup_s']} s, compile {row['compile_ms']}, "
                       f"mask {row['mask_us']}, advance {row['advance_us']}")  # fmt: skip
    command = "python -m benchmarks.grammar_engines" + (f" --engine {engine_dir}" if engine_dir else "")
    from importlib.metadata import version

    versions = {name: version(name) for name in ENGINES}
    write_report(output, {"command": command, "engine_versions": versions, "imports_s": imports,
                          "schemas": len(schemas), "rows": rows}, render)  # fmt: skip


def render(payload: dict) -> str:
    cell: Callable[[dict], str] = lambda s: f"{s['median']} / {s['p99']}"  # noqa: E731
    lines = [
        "# Grammar engines: xgrammar vs llguidance", "",
        f"Machine: {payload['machine']}; versions: "
        + ", ".join(f"{k} {v}" for k, v in payload["engine_versions"].items()), "",
        f"Command: `{payload['command']}`; {payload['schemas']} JSON schemas (tests/data/structured_schemas.json), "
        "compiled with each engine's cache off, each walked by random allowed tokens.", "",
        f"Cold import (fresh interpreter): {', '.join(f'{k} {v} s' for k, v in payload['imports_s'].items())}", "",
        "| tokenizer | engine | vocab setup s | compile ms (median / p99) | first matcher ms | mask µs/token "
        "(median / p99) | advance µs/token | rollback(3) µs | tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in payload["rows"]:
        lines.append(f"| {r['tokenizer']} | {r['engine']} | {r['setup_s']} | {cell(r['compile_ms'])} | "
                     f"{cell(r['matcher_ms'])} | {cell(r['mask_us'])} | {cell(r['advance_us'])} | "
                     f"{cell(r['rollback_us'])} | {r['tokens']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
