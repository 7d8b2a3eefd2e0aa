"""A scheduled batch turned into the backend's chunks: which tokens each request runs, which of
them are speculative drafts, and where its logits rows land in the step's output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from executors.base import SequenceChunk
from executors.device_sampling import PendingSample
from executors.sampling import SamplingState
from runtime.engine.request import Request

if TYPE_CHECKING:
    from runtime.engine.scheduler import ScheduledBatch


@dataclass(slots=True)
class StepChunks:
    """A step's chunks with the request each belongs to, in the same order: parallel lists (no object per
    request per step beyond the backend's own chunk). A decode chunk ends in `num_logits - 1` speculative
    drafts; a prefill chunk of a request scoring its prompt has a row per token; the backend returns
    `num_logits` rows per chunk, in order."""

    requests: list[Request]
    chunks: list[SequenceChunk]
    completes: list[bool]  # the chunk reaches its request's last token, so a token is sampled from its logits
    drafting: bool  # some chunk ends in drafts (verified on the host, from the logits of every draft position)
    scoring: bool = False  # some chunk scores its prompt: a logits row per token, read on the host

    def sampling_rows(self) -> list[SamplingState | None]:
        """Each chunk's sampling state if a token is sampled from it, else None (device sampling's rows)."""
        return [r.sampling if c else None for r, c in zip(self.requests, self.completes, strict=True)]


def build_chunks(num_tokens: dict[Request, int]) -> StepChunks:
    """A decode given more tokens than it has uncomputed runs its drafts after them (the scheduler
    trimmed draft_token_ids to what it allocated). A chunk's block table is the request's own list, not a
    copy: the KV cache manager never changes a request's list in place, it gives the request a new one."""
    chunks: list[SequenceChunk] = []
    completes: list[bool] = []
    drafting = scoring = False
    for request, n in num_tokens.items():
        start, tokens = request.num_computed_tokens, request.all_token_ids
        uncomputed = len(tokens) - start
        if n == uncomputed == 1:  # a decode's one token: most chunks of most steps
            chunks.append(SequenceChunk(tokens[start:], start, request.block_ids, 1, request.slot, request.lora_slot))
            completes.append(True)
            continue
        if request.scores_prompt:  # a prefill that returns a logits row per token (never with drafts)
            chunks.append(
                SequenceChunk(tokens[start : start + n], start, request.block_ids, n, request.slot, request.lora_slot)
            )
            completes.append(start + n == len(tokens))
            scoring = True
            continue
        num_drafts = max(0, n - uncomputed)  # the scheduler kept that many of draft_token_ids
        ids = tokens[start : start + n - num_drafts]
        if num_drafts:
            ids += request.draft_token_ids[:num_drafts]
            drafting = True
        chunks.append(SequenceChunk(ids, start, request.block_ids, 1 + num_drafts, request.slot, request.lora_slot))
        completes.append(start + n - num_drafts == len(tokens))
    return StepChunks(list(num_tokens), chunks, completes, drafting, scoring)


@dataclass(frozen=True)
class InFlight:
    """An overlapped step launched on the device, its tokens not yet on the host."""

    placed: list[tuple[Request, int, int]]  # its sampled rows: (request, row, index of the placeholder token)
    pending: PendingSample
    step: StepChunks
    batch: ScheduledBatch
    start: float  # clock seconds when it was scheduled
