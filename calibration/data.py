"""Calibration and held-out text: real text that ships with a package, never a hub download.

Two sources, both permissively licensed and installed by the project's own dependencies:
- chat: the English dialogs of the `chatterbot-corpus` PyPI package (BSD-3-Clause), each
  conversation rendered through the model's own chat template;
- plain: the prose of the Python documentation topics in the standard library's
  `pydoc_data.topics` (PSF licence), split into paragraphs.

Documents are shuffled with a fixed seed and split, so the calibration set and the held-out
set never share a document. Sizes, seed and a sha256 of each set go into the manifest.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.resources
import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

CHAT_PACKAGE = "chatterbot-corpus"
# Prompts with known answers, written for this project (see the file for the format).
QA_FILE = Path(__file__).with_name("qa_prompts.json")


@dataclass(frozen=True)
class DataConfig:
    calibration_samples: int = 64  # sequences; half chat, half plain
    heldout_samples: int = 32
    seq_len: int = 256  # tokens per sequence
    seed: int = 0


@dataclass(frozen=True)
class TextSets:
    """Token sequences for calibration and evaluation, plus how they were made."""

    calibration: list[list[int]]
    heldout: list[list[int]]
    qa_prompts: list[dict] = field(default_factory=list)
    record: dict = field(default_factory=dict)


def chat_documents() -> list[list[dict]]:
    """Every English conversation of chatterbot-corpus as chat messages (user/assistant turns)."""
    root = importlib.resources.files("chatterbot_corpus") / "data" / "english"
    conversations = []
    for path in sorted(root.iterdir(), key=lambda p: p.name):
        if not path.name.endswith(".yml"):
            continue
        for turns in yaml.safe_load(path.read_text(encoding="utf-8")).get("conversations", []):
            texts = [str(t).strip() for t in turns if str(t).strip()]
            if len(texts) >= 2:
                roles = ("user", "assistant")
                conversations.append([{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)])
    return conversations


def plain_documents() -> list[str]:
    """Paragraphs of the Python documentation's prose (stdlib pydoc_data), code lines dropped."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for block in topics[name].split("\n\n"):
            lines = [line.strip() for line in block.splitlines()]
            text = " ".join(line for line in lines if line and not line.startswith((">>>", "...", "*")))
            if len(text.split()) >= 20 and text.count("(") < len(text) / 40:
                paragraphs.append(text)
    return paragraphs


def _pack(documents: Iterable[list[int]], count: int, seq_len: int) -> list[list[int]]:
    """Concatenate tokenized documents into `count` sequences of exactly `seq_len` tokens."""
    sequences, current = [], []
    for doc in documents:
        current += doc
        while len(current) >= seq_len and len(sequences) < count:
            sequences.append(current[:seq_len])
            current = current[seq_len:]
        if len(sequences) == count:
            return sequences
    raise ValueError(f"not enough text for {count} sequences of {seq_len} tokens (made {len(sequences)})")


def _digest(sequences: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(sequences).encode()).hexdigest()


def load_text_sets(tokenizer, config: DataConfig = DataConfig()) -> TextSets:
    """Tokenize, shuffle (seeded) and split both sources; half of each set is chat, half plain."""
    rng = random.Random(config.seed)
    chats, plain = chat_documents(), plain_documents()
    rng.shuffle(chats)
    rng.shuffle(plain)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    template = getattr(tokenizer, "chat_template", None)

    def chat_tokens(messages: list[dict]) -> list[int]:
        if template:
            return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
        return tokenizer.encode("\n".join(m["content"] for m in messages)) + eos

    sets = {}
    for name, docs_chat, docs_plain, count in (
        ("calibration", chats[: len(chats) // 2], plain[: len(plain) // 2], config.calibration_samples),
        ("heldout", chats[len(chats) // 2 :], plain[len(plain) // 2 :], config.heldout_samples),
    ):
        chat_part = _pack((chat_tokens(m) for m in docs_chat), count // 2, config.seq_len)
        plain_part = _pack((tokenizer.encode(t) + eos for t in docs_plain), count - count // 2, config.seq_len)
        sets[name] = chat_part + plain_part
    record = {
        "sources": {
            "chat": f"{CHAT_PACKAGE}=={importlib.metadata.version(CHAT_PACKAGE)} (data/english/*.yml, BSD-3-Clause)",
            "plain": "Python standard library pydoc_data.topics (PSF licence)",
        },
        "seed": config.seed,
        "seq_len": config.seq_len,
        "split": "documents shuffled with the seed; first half of each source calibrates, second half is held out",
        **{f"{name}_sequences": len(seqs) for name, seqs in sets.items()},
        **{f"{name}_sha256": _digest(seqs) for name, seqs in sets.items()},
    }
    qa = json.loads(QA_FILE.read_text())["prompts"]
    return TextSets(sets["calibration"], sets["heldout"], qa, record)
