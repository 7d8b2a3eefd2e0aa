"""Prompt-prefix hashes, and each replica's index of the prefixes recently routed to it.

Why character chunks predict the engine's KV hits (the gateway has no tokenizer): the engine
(runtime/engine/kv_cache_manager.py) reuses a KV block when the whole token prefix up to the end of that
block equals one it computed, chaining each full block's hash through the previous one. Tokenizing is a
deterministic function of the text, and BPE pre-tokenization splits at spaces and punctuation, so two
prompts whose texts agree on their first C characters agree on their tokens up to about the word where
they part: ~C / (characters per token) tokens, that many / block_size reusable blocks on the replica that
computed the first. Hashing fixed-size character chunks chained the same way makes "chunk k is in this
replica's index" mean "this whole k-chunk prefix was sent there", so matched chunks grow with the blocks
that replica can reuse. Only full chunks are hashed, as the engine caches only full blocks.

Prefixes are keyed by the request's cache salt too (the tenant's, runtime.gateway.tenants), as the engine
keys its blocks: a prompt matches only prompts sent under the same salt, so neither routing nor the
`prefix_match` pick counter on the public /metrics can tell one tenant whether another sent a prompt.

Chat requests are keyed by their messages in order: the engine renders them with the model's chat
template, which is prefix-stable (equal leading messages render to equal leading text), so a shared
conversation head is a shared rendered prefix.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from runtime.gateway.wire import GenerateRequest

ROLE_END, MESSAGE_END = "\x1f", "\x1e"  # unit / record separators between a message's role, content and the next


def prompt_text(request: GenerateRequest) -> str:
    """The text whose prefix decides the replica: the raw prompt (token ids as decimal words), or the messages
    in order."""
    if isinstance(request.prompt, list):
        return "".join(f"{t} " for t in request.prompt)
    if request.messages is None:
        return request.prompt or ""
    return "".join(f"{m['role']}{ROLE_END}{m['content']}{MESSAGE_END}" for m in request.messages)


def chunk_hashes(text: str, chunk_chars: int, max_chunks: int, salt: str | None = None) -> list[bytes]:
    """Chained hashes of the first full `chunk_chars`-character chunks of `text` (at most `max_chunks`):
    hash k covers chunks 0..k, so equal hashes mean equal whole prefixes. The chain starts from the
    request's cache salt, as the engine's block hashes do: prompts match only under the same salt."""
    hashes: list[bytes] = []
    parent = b"" if salt is None else hashlib.blake2b(b"salt\0" + salt.encode(), digest_size=16).digest()
    for start in range(0, min(len(text) // chunk_chars, max_chunks) * chunk_chars, chunk_chars):
        chunk = text[start : start + chunk_chars].encode("utf-8", "surrogatepass")  # JSON allows lone surrogates
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Chunk hashes recently routed to one replica, at most `capacity`, least recently routed evicted first.

    A bounded LRU approximates the replica's own cache, which is bounded and evicts least recently used
    blocks too. Within one request the tail is evicted before the head (the engine frees a request's blocks
    tail first as well), so a long prompt's shared head outlives its unique tail.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading chunks of a prompt (its chunk_hashes) were routed here."""
        matched = 0
        for h in hashes:
            if h not in self._lru:
                break
            matched += 1
        return matched

    def insert(self, hashes: Sequence[bytes]) -> None:
        """Record a prompt routed here: its head becomes the most recently used."""
        for h in reversed(hashes):
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()
