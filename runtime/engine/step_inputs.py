"""A scheduled batch turned into the backend's chunks: which tokens each request runs, which of
them are speculative drafts, and where its logits rows land in the step's output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from executors.base import SequenceChunk
from executors.device_sampling import PendingSample
from runtime.engine.request import Request

if TYPE_CHECKING:
    from runtime.engine.scheduler import ScheduledBatch

NO_DRAFTS: list[int] = []  # shared, never changed


@dataclass(slots=True)  # not frozen: one per request per step (as SequenceChunk)
class ScheduledChunk:
    request: Request
    num_tokens: int  # this step's tokens, drafts included
    drafts: list[int]  # the speculative tokens the chunk ends in (copied: verified after the backend ran)
    first_row: int  # its first logits row: the backend returns 1 + len(drafts) rows per chunk, in order
    completes: bool  # the chunk reaches the request's last token, so a token is sampled from its logits


def build_chunks(num_tokens: dict[Request, int]) -> tuple[list[ScheduledChunk], list[SequenceChunk]]:
    """A decode given more tokens than it has uncomputed runs its drafts after them (the scheduler
    trimmed draft_token_ids to what it allocated). A chunk's block table is the request's own list, not a
    copy: the KV cache manager never changes a request's list in place, it gives the request a new one."""
    scheduled, chunks, row = [], [], 0
    for request, n in num_tokens.items():
        start, tokens = request.num_computed_tokens, request.all_token_ids
        uncomputed = len(tokens) - start
        if n == uncomputed == 1:  # a decode's one token: most chunks of most steps
            chunks.append(SequenceChunk(tokens[start:], start, request.block_ids))
            scheduled.append(ScheduledChunk(request, 1, NO_DRAFTS, row, True))
            row += 1
            continue
        drafts = list(request.draft_token_ids[: n - uncomputed]) if n > uncomputed else NO_DRAFTS
        ids = tokens[start : start + n - len(drafts)]
        chunks.append(SequenceChunk(ids + drafts if drafts else ids, start, request.block_ids, 1 + len(drafts)))
        scheduled.append(ScheduledChunk(request, n, drafts, row, start + n - len(drafts) == len(tokens)))
        row += 1 + len(drafts)
    return scheduled, chunks


@dataclass(frozen=True)
class InFlight:
    """An overlapped step launched on the device, its tokens not yet on the host."""

    placed: list[tuple[Request, int, int]]  # its sampled rows: (request, row, index of the placeholder token)
    pending: PendingSample
    chunks: list[SequenceChunk]
    batch: ScheduledBatch
    start: float  # clock seconds when it was scheduled
