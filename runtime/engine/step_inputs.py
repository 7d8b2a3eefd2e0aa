"""A scheduled batch turned into the backend's chunks: which tokens each request runs, which of
them are speculative drafts, and where its logits rows land in the step's output."""

from __future__ import annotations

from dataclasses import dataclass

from executors.base import SequenceChunk
from runtime.engine.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_tokens: int  # this step's tokens, drafts included
    drafts: list[int]  # the speculative tokens the chunk ends in (copied: verified after the backend ran)
    first_row: int  # its first logits row: the backend returns 1 + len(drafts) rows per chunk, in order

    @property
    def completes(self) -> bool:
        """The chunk reaches the request's last token, so a token is sampled from its logits."""
        return self.request.num_computed_tokens + self.num_tokens - len(self.drafts) == self.request.num_tokens


def build_chunks(num_tokens: dict[Request, int]) -> tuple[list[ScheduledChunk], list[SequenceChunk]]:
    """A decode given more tokens than it has uncomputed runs its drafts after them (the scheduler
    trimmed draft_token_ids to what it allocated)."""
    scheduled, chunks, row = [], [], 0
    for request, n in num_tokens.items():
        start = request.num_computed_tokens
        drafts = list(request.draft_token_ids[: max(0, n - request.num_tokens_to_compute)])
        tokens = request.all_token_ids[start : start + n - len(drafts)] + drafts
        chunks.append(SequenceChunk(tokens, start, list(request.block_ids), num_logits=1 + len(drafts)))
        scheduled.append(ScheduledChunk(request, n, drafts, row))
        row += 1 + len(drafts)
    return scheduled, chunks
