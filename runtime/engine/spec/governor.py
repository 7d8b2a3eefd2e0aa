"""Speculation only where it pays, measured online.

Whether drafts speed decoding up depends on things known only at run time: how often they are
accepted (copy-heavy answers vs chat), what a draft pass costs against a target pass on this machine
(an INT4 draft of the same model: 0.4 of a target step here with its LM head in INT4, 0.55 without),
and the batch size. So the governor measures both modes: per running-batch size, the wall time per
emitted token of decode-only steps with drafts (the proposer's time included, but not a draft engine's
one-off catch-up: SpecDecoder.observe_step) and without, as moving averages. The cheaper mode runs;
the other is re-measured for `probe_steps` steps, `period` steps after the choice, so a change (content
that copies more, another load on the machine) is noticed. A probe that confirms the choice doubles the
wait before the next one (up to `max_period`): probing costs (a draft engine first catches every
request up on the tokens it missed), and a choice that keeps being confirmed is safe. A probe that
flips the choice resets the wait. Until a mode has `probe_steps` samples it is measured first,
speculation before plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Moving-average weight of a new step's seconds and tokens (a plain mean over the first 1 / EWMA_ALPHA
# steps): ~20 steps of evidence. Acceptance comes in bursts (an answer copies, then writes its own):
# a shorter window turned n-gram speculation off on chat for a few rejected drafts (1.27x instead of
# 1.46x single-stream).
EWMA_ALPHA = 0.05


@dataclass
class ModeCost:
    """Seconds per emitted token of one mode at one batch size: moving averages of a step's seconds and
    of its tokens, divided (a ratio of sums: averaging per-step ratios would weigh a drafted step that
    emitted 1 token as much as one that emitted 5, and call speculation that pays a loss)."""

    samples: int = 0
    seconds: float = 0.0
    tokens: float = 0.0

    def observe(self, seconds: float, tokens: int) -> None:
        weight = max(1.0 / (self.samples + 1), EWMA_ALPHA)
        self.seconds += weight * (seconds - self.seconds)
        self.tokens += weight * (tokens - self.tokens)
        self.samples += 1

    @property
    def s_per_token(self) -> float:
        return self.seconds / self.tokens if self.tokens else float("inf")


@dataclass
class BatchSizeCosts:
    speculating: ModeCost = field(default_factory=ModeCost)
    plain: ModeCost = field(default_factory=ModeCost)
    steps: int = 0  # decode-only steps observed at this batch size
    choice: bool | None = None  # speculate? (the cheaper mode when last judged; None: still measuring)
    wait: int = 0  # steps from one probe to the next
    next_probe: int = 0  # the step count at which the next probe starts


class SpeculationGovernor:
    def __init__(self, period: int = 64, probe_steps: int = 4, max_period: int = 1024) -> None:
        if not 0 < probe_steps < period <= max_period:
            raise ValueError(f"need 0 < probe_steps ({probe_steps}) < period ({period}) <= max_period ({max_period})")
        self.period, self.probe_steps, self.max_period = period, probe_steps, max_period
        self.costs: dict[int, BatchSizeCosts] = {}

    def speculate(self, batch_size: int) -> bool:
        """Whether the next step of `batch_size` running requests should carry drafts."""
        c = self.costs.setdefault(batch_size, BatchSizeCosts())
        if c.speculating.samples < self.probe_steps:
            return True
        if c.plain.samples < self.probe_steps:
            return False
        pays = c.speculating.s_per_token <= c.plain.s_per_token
        if pays != c.choice:  # first judgement, or a probe (or the chosen mode's own drift) flipped it
            c.choice, c.wait, c.next_probe = pays, self.period, c.steps + self.period
        elif c.steps >= c.next_probe + self.probe_steps:  # a probe ended and confirmed the choice
            c.wait = min(2 * c.wait, self.max_period)
            c.next_probe = c.steps + c.wait
        probing = c.next_probe <= c.steps < c.next_probe + self.probe_steps
        return pays != probing  # the cheaper mode, except while the other is probed

    def observe(self, batch_size: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A decode-only step of `batch_size` requests ran in `seconds` and emitted `tokens` tokens."""
        if seconds <= 0 or tokens <= 0:  # a clock that did not move (a test's) measured nothing
            return
        c = self.costs.setdefault(batch_size, BatchSizeCosts())
        (c.speculating if speculated else c.plain).observe(seconds, tokens)
        c.steps += 1
