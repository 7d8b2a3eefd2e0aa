"""The reliability benchmark's traffic: what a chat service's clients send, seeded, sized to the engine.

Three kinds of request, as a served assistant sees them: RAG questions over a few shared ~1,300-token
documents (the prefix cache's share; text from pydoc_data.topics, as benchmarks.datasets cuts it),
multi-turn chats whose earlier answers are fed back (so a chat's next turn exists only once its previous
answer came back: conversations are picked when a request is sent, not when it is planned), and one-shot
questions through /v1/completions. Answers of 16-384 tokens (log-uniform: many short, a few long; EOS
ignored, so the load is what was asked for), streamed or not, ~20% of streams cancelled by the client
mid-stream. Arrivals are Poisson with an on/off-modulated rate: `burst_period_s` at 2/3 of the mean rate,
then as long at 4/3 of it, so bursts queue work the calm periods drain.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from benchmarks.datasets import CHAT_PROMPTS, text_slices

KINDS = ("rag", "chat", "oneshot")
FOLLOW_UPS = ("Can you explain that in more detail?", "Give me a concrete example.", "Why is that so?",
              "Summarise your last answer in one sentence.", "What would be a common mistake here?")  # fmt: skip
TEMPLATE_MARGIN = 16  # tokens of slack between the client's count of a chat prompt and the server's


@dataclass(frozen=True)
class Mix:
    """The traffic's shape; `fit` scales its sizes to an engine's max_seq_len."""

    rag: float = 0.4  # share of RAG requests; chat the next share, one-shot the rest
    chat: float = 0.3
    stream: float = 0.7  # share of streamed requests
    cancel: float = 0.2  # share of streams the client cancels mid-stream
    answer_tokens: tuple[int, int] = (16, 384)
    doc_tokens: int = 1300
    documents: int = 3
    turns: tuple[int, int] = (2, 5)  # turns of a conversation
    burst_period_s: float = 30.0

    def fit(self, max_seq_len: int) -> Mix:
        """The same mix for an engine of `max_seq_len`: answers at most a quarter of it, documents what is left
        after an answer and the question (the test engines hold 256-512 tokens; SmolLM2's 2048 keeps the defaults)."""
        high = min(self.answer_tokens[1], max_seq_len // 4)
        low = min(self.answer_tokens[0], high)
        return replace(self, answer_tokens=(low, high), doc_tokens=min(self.doc_tokens, max_seq_len - high - 96))


@dataclass(frozen=True)
class Job:
    """One planned request: when it is sent and what it asks for (its prompt is built when it is sent)."""

    index: int
    at: float  # seconds after the load started
    kind: str  # one of KINDS
    stream: bool
    max_tokens: int
    cancel_after: int | None  # deltas after which the client cancels (streams only)
    pick: int  # which document / question
    tenant: str | None = None  # whose API key it is sent with (benchmarks.reliability_tenants)


def rate_at(t: float, rate: float, period_s: float) -> float:
    """The modulated arrival rate at `t`: calm (2/3) then burst (4/3) periods; mean `rate`."""
    return rate * (2 / 3 if int(t // period_s) % 2 == 0 else 4 / 3)


def jobs(rate: float, mix: Mix, seed: int = 0) -> Iterator[Job]:
    """Planned requests, without end (the caller stops taking them). Arrivals by thinning a Poisson process
    at the peak rate, so the rate can change within a gap."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = np.random.default_rng(seed)
    peak, t, index = rate * 4 / 3, 0.0, 0
    low, high = mix.answer_tokens
    while True:
        t += float(rng.exponential(1 / peak))
        if rng.random() * peak > rate_at(t, rate, mix.burst_period_s):
            continue
        draw = rng.random()
        kind = "rag" if draw < mix.rag else "chat" if draw < mix.rag + mix.chat else "oneshot"
        stream = bool(rng.random() < mix.stream)
        max_tokens = round(math.exp(rng.uniform(math.log(low), math.log(high))))
        cancel = stream and rng.random() < mix.cancel
        cancel_after = int(rng.integers(1, max(2, max_tokens // 2))) if cancel else None
        yield Job(index, t, kind, stream, max_tokens, cancel_after, int(rng.integers(1 << 30)))
        index += 1


@dataclass
class Conversation:
    id: int
    messages: list[dict[str, str]]
    turns_left: int
    busy: bool = False


@dataclass
class Prompts:
    """Builds each job's request body; owns the documents and the conversations in progress."""

    tokenizer: object
    mix: Mix
    max_seq_len: int
    model: str
    seed: int = 0
    documents: list[str] = field(default_factory=list)
    questions: list[str] = field(default_factory=list)
    conversations: list[Conversation] = field(default_factory=list)
    _next_id: int = 0

    def __post_init__(self) -> None:
        slices = text_slices(self.tokenizer, self.mix.documents, self.mix.doc_tokens, self.seed + 4000)
        self.documents = [self.tokenizer.decode(s) for s in slices]
        self.questions = CHAT_PROMPTS.read_text().splitlines()

    def chat_tokens(self, messages: list[dict[str, str]]) -> int:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(self.tokenizer.encode(text, add_special_tokens=False)) + TEMPLATE_MARGIN

    def body(self, job: Job) -> tuple[str, dict, Conversation | None]:
        """(path, JSON body, the conversation it continues) for `job`."""
        common = {"model": self.model, "stream": job.stream, "ignore_eos": True, "temperature": 0.7}
        if job.stream:
            common["stream_options"] = {"include_usage": True}
        question = self.questions[job.pick % len(self.questions)]
        if job.kind == "oneshot":
            prompt = f"Question: {question}\nAnswer:"
            room = self.max_seq_len - len(self.tokenizer.encode(prompt, add_special_tokens=False)) - 1
            body = {**common, "prompt": prompt, "max_tokens": min(job.max_tokens, room), "user": f"u{job.pick % 16}"}
            return "/v1/completions", body, None
        if job.kind == "rag":
            document = self.documents[job.pick % len(self.documents)]
            messages = [{"role": "system", "content": f"Answer using the document below.\n\n{document}"},
                        {"role": "user", "content": question}]  # fmt: skip
            conversation = None
            user = f"u{job.pick % 16}"
        else:
            conversation, messages = self._turn(job, question)
            user = f"c{conversation.id}"
        room = self.max_seq_len - self.chat_tokens(messages)
        body = {**common, "messages": messages, "max_tokens": max(1, min(job.max_tokens, room)), "user": user}
        return "/v1/chat/completions", body, conversation

    def _turn(self, job: Job, question: str) -> tuple[Conversation, list[dict[str, str]]]:
        """The next turn of an idle conversation (a new one when none is idle, or its history is too long)."""
        idle = [c for c in self.conversations if not c.busy]
        if idle:
            conversation = idle[job.pick % len(idle)]
            follow = FOLLOW_UPS[job.pick % len(FOLLOW_UPS)]
            messages = [*conversation.messages, {"role": "user", "content": follow}]
            if self.chat_tokens(messages) + job.max_tokens <= self.max_seq_len:
                conversation.busy, conversation.messages = True, messages
                return conversation, messages
            self.conversations.remove(conversation)
        low, high = self.mix.turns
        conversation = Conversation(self._next_id, [{"role": "user", "content": question}],
                                    low + job.pick % (high - low + 1) - 1, busy=True)  # fmt: skip
        self._next_id += 1
        self.conversations.append(conversation)
        return conversation, conversation.messages

    def answered(self, conversation: Conversation | None, answer: str | None) -> None:
        """Feed a turn's answer back (None: it did not complete; the user leaves the conversation)."""
        if conversation is None:
            return
        conversation.busy = False
        if answer is None or conversation.turns_left <= 0:
            self.conversations.remove(conversation)
            return
        conversation.messages = [*conversation.messages, {"role": "assistant", "content": answer}]
        conversation.turns_left -= 1
