"""Benchmark workloads, built once in the project venv and sent identically to every engine.

Each request carries the exact prompt text (what trtserve's `text_input` gets, tokenized by
the server) and its token ids (what vLLM, llama.cpp, onnxruntime-genai and HF get), so every
engine sees the same tokens; the client checks the server's prompt token count against them.

Text comes with Python itself: `pydoc_data.topics` (the Python language reference, PSF
licence, ~465k characters of English prose), never a hub download. Chat questions are in
data/chat_prompts.txt, copy-heavy requests in data/copy_heavy_prompts.json (both written for this repo).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHAT_PROMPTS = Path(__file__).parent / "data" / "chat_prompts.txt"
COPY_HEAVY_PROMPTS = Path(__file__).parent / "data" / "copy_heavy_prompts.json"
DATASETS = ("fixed", "chat", "prefix", "mixed")


@dataclass(frozen=True)
class BenchRequest:
    prompt: str  # chat template already applied where the dataset uses one
    prompt_ids: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool


@dataclass(frozen=True)
class ChatRequest(BenchRequest):
    """A request sent as chat messages (OpenAI /v1/chat/completions): `prompt` / `prompt_ids` are its messages in
    the model's chat template (what the servers render; the client checks their prompt token count against
    them), sampled at `temperature` with `seed` (None: the server's)."""

    messages: tuple[tuple[str, str], ...] = ()  # (role, content)
    temperature: float = 0.0
    seed: int | None = None


def chat_request(tokenizer, user: str, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                 ignore_eos: bool = False) -> ChatRequest:  # fmt: skip
    """One user turn as a ChatRequest (EOS honoured unless `ignore_eos`)."""
    prompt = _chat(tokenizer, user)
    ids = tuple(tokenizer.encode(prompt, add_special_tokens=False))
    return ChatRequest(prompt, ids, max_tokens, ignore_eos, (("user", user),), temperature, seed)


def corpus_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


_CORPUS_IDS: dict[int, list[int]] = {}  # id(tokenizer) -> corpus token ids (tokenizing it takes ~1 s)


def text_slices(tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` token runs of exactly `length` from random offsets of the corpus that survive
    decode -> encode unchanged (so the server's own tokenization gives the same ids)."""
    if id(tokenizer) not in _CORPUS_IDS:
        _CORPUS_IDS[id(tokenizer)] = tokenizer.encode(corpus_text(), add_special_tokens=False)
    ids = _CORPUS_IDS[id(tokenizer)]
    rng = np.random.default_rng(seed)
    out: list[list[int]] = []
    for _ in range(count * 50):
        if len(out) == count:
            return out
        start = int(rng.integers(0, len(ids) - length - 1))
        piece = ids[start : start + length]
        if tokenizer.encode(tokenizer.decode(piece), add_special_tokens=False) == piece:
            out.append(piece)
    raise RuntimeError(f"could not cut {count} round-trip-stable slices of {length} tokens")


def _chat(tokenizer, user: str, system: str | None = None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _request(tokenizer, text: str, max_tokens: int, ignore_eos: bool) -> BenchRequest:
    return BenchRequest(text, tuple(tokenizer.encode(text, add_special_tokens=False)), max_tokens, ignore_eos)


def fixed(tokenizer, count: int, input_len: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    """Exactly input_len prompt tokens (raw text, no template) and output_len tokens, EOS ignored."""
    return [
        BenchRequest(tokenizer.decode(p), tuple(p), output_len, True)
        for p in text_slices(tokenizer, count, input_len, seed)
    ]


def chat(tokenizer, count: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    """Real chat questions in the model's chat template; every third one asks to summarise a
    100-500-token passage (a realistic spread of prompt lengths). EOS honoured, capped at
    output_len tokens: answers end where the model ends them."""
    questions = CHAT_PROMPTS.read_text().splitlines()
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        if i % 3 == 2:
            passage = tokenizer.decode(text_slices(tokenizer, 1, int(rng.integers(100, 500)), seed + i)[0])
            user = f"Summarise the following passage in two sentences.\n\n{passage}"
        else:
            user = questions[int(rng.integers(len(questions)))]
        out.append(_request(tokenizer, _chat(tokenizer, user), output_len, False))
    return out


def copy_heavy(tokenizer, count: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    """Requests whose answer repeats or edits a passage given in the prompt (rewrite with one change,
    rename in code, fix a typo: data/copy_heavy_prompts.json, written for this repo), in the chat
    template, cycling through the prompts in a seeded order. EOS honoured, capped at output_len."""
    prompts = json.loads(COPY_HEAVY_PROMPTS.read_text())
    order = np.random.default_rng(seed).permutation(len(prompts))
    users = [prompts[order[i % len(prompts)]] for i in range(count)]
    return [_request(tokenizer, _chat(tokenizer, f"{u['instruction']}\n\n{u['passage']}"), output_len, False)
            for u in users]  # fmt: skip


def shared_prefix(
    tokenizer, count: int, output_len: int, system_len: int = 1000, seed: int = 0, first_question: int = 0
) -> list[BenchRequest]:
    """Chat requests sharing one ~system_len-token system prompt, each with its own question:
    the prefix-caching workload. EOS ignored so on/off runs do the same work. Questions are
    numbered from first_question, so separate calls never repeat a whole prompt."""
    system = "Answer questions about the Python language reference below.\n\n" + tokenizer.decode(
        text_slices(tokenizer, 1, system_len, seed + 1000)[0]
    )
    questions = CHAT_PROMPTS.read_text().splitlines()
    numbers = range(first_question, first_question + count)
    users = [f"Question {i}: {questions[i % len(questions)]}" for i in numbers]
    return [_request(tokenizer, _chat(tokenizer, user, system), output_len, True) for user in users]


def many_system_prompts(
    tokenizer, count: int, output_len: int, prompts: int = 8, system_len: int = 400, seed: int = 0
) -> list[BenchRequest]:
    """`count` chat requests, each from one of `prompts` distinct ~system_len-token system prompts
    (picked uniformly, seeded) with a short numbered user question: many users of a few assistants,
    the multi-replica prefix-routing workload. EOS ignored, so every routing policy does the same work."""
    texts = [tokenizer.decode(s) for s in text_slices(tokenizer, prompts, system_len, seed + 2000)]
    systems = [f"You are assistant {i}. Answer questions about the passage below.\n\n{t}" for i, t in enumerate(texts)]
    questions = CHAT_PROMPTS.read_text().splitlines()
    rng = np.random.default_rng(seed)
    picks = [(int(rng.integers(prompts)), int(rng.integers(len(questions)))) for _ in range(count)]
    return [_request(tokenizer, _chat(tokenizer, f"User {j}: {questions[q]}", systems[s]), output_len, True)
            for j, (s, q) in enumerate(picks)]  # fmt: skip


def mixed(
    tokenizer,
    count: int,
    seed: int = 0,
    systems: int = 3,
    system_len: int = 300,
    turn_mean: int = 80,
    answer_range: tuple[int, int] = (16, 256),
) -> list[BenchRequest]:
    """Traffic shaped like a chat service: every request starts with one of `systems` shared
    ~system_len-token system prompts (the prefix cache's share), then a user turn of lognormal length
    (mean ~turn_mean tokens, at least 8) cut from the corpus, and asks for a uniform answer length in
    answer_range with EOS ignored (so every server does the same work). Seeded; the system prompts
    depend only on `systems`/`system_len`, so every seed shares them and only the turns differ."""
    texts = [tokenizer.decode(s) for s in text_slices(tokenizer, systems, system_len, 3000)]
    prompts = [f"You are assistant {i}. Use the reference text below when it helps.\n\n{t}"
               for i, t in enumerate(texts)]  # fmt: skip
    rng = np.random.default_rng(seed)
    sigma = 0.6  # lognormal spread of user turns; mu keeps the mean at turn_mean
    lengths = np.maximum(8, rng.lognormal(np.log(turn_mean) - sigma**2 / 2, sigma, count).astype(int))
    turns = [tokenizer.decode(text_slices(tokenizer, 1, int(n), seed * 100_003 + i)[0]) for i, n in enumerate(lengths)]
    out = []
    for turn in turns:
        system = prompts[int(rng.integers(systems))]
        max_tokens = int(rng.integers(answer_range[0], answer_range[1] + 1))
        out.append(_request(tokenizer, _chat(tokenizer, f"Reply to this note:\n{turn}", system), max_tokens, True))
    return out


def build(name: str, tokenizer, count: int, input_len: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    if name == "fixed":
        return fixed(tokenizer, count, input_len, output_len, seed)
    if name == "chat":
        return chat(tokenizer, count, output_len, seed)
    if name == "prefix":
        return shared_prefix(tokenizer, count, output_len, seed=seed)
    if name == "mixed":
        return mixed(tokenizer, count, seed=seed)
    raise ValueError(f"unknown dataset {name!r} (one of {DATASETS})")


def describe(requests: list[BenchRequest]) -> dict:
    lengths = [len(r.prompt_ids) for r in requests]
    digest = hashlib.sha256(json.dumps([r.prompt_ids for r in requests]).encode()).hexdigest()[:16]
    return {
        "count": len(requests),
        "prompt_tokens_min_mean_max": [min(lengths), round(sum(lengths) / len(lengths), 1), max(lengths)],
        "max_tokens": sorted({r.max_tokens for r in requests}),
        "ignore_eos": sorted({r.ignore_eos for r in requests}),
        "prompt_ids_sha256": digest,
        "text_source": f"pydoc_data.topics (Python {sys.version.split()[0]}) + benchmarks/data/chat_prompts.txt",
    }
