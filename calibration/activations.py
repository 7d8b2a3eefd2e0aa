"""Activation statistics of each linear group's input, from the fp32 model on calibration text."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from calibration.linears import LinearGroup, linear_groups, lm_head_group
from engine_format import ceil_div


@dataclass
class InputStats:
    """Per input channel: mean |x| and max |x|; a fixed sample of input rows for the searches;
    optionally the sum of x xᵀ over every token (GPTQ's second moment)."""

    abs_sum: torch.Tensor
    abs_max: torch.Tensor
    rows: list[torch.Tensor]
    count: int = 0
    outer_sum: torch.Tensor | None = None

    @property
    def abs_mean(self) -> torch.Tensor:
        return self.abs_sum / max(self.count, 1)

    @property
    def second_moment(self) -> torch.Tensor:
        """E[x xᵀ] [in, in] over every calibration token."""
        if self.outer_sum is None:
            raise ValueError("second moments were not collected (collect_input_stats(second_moments=True))")
        return self.outer_sum / max(self.count, 1)

    @property
    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows)


def activation_ranges(model, spec, sequences: list[list[int]]) -> dict[str, np.ndarray]:
    """max |x| per input channel of every graph MatMul (keyed by its name) and of the LM head, on `sequences`:
    what the cpu-int8 backend smooths its per-token activation quantization with (engine_format.files
    ACTIVATION_RANGES_FILE)."""
    groups = [*linear_groups(spec), lm_head_group(spec)]
    stats = collect_input_stats(model, groups, sequences, sample_rows=len(groups))
    return {name: entry.abs_max.numpy().astype(np.float32) for name, entry in stats.items()}


@torch.no_grad()
def collect_input_stats(
    model, groups: list[LinearGroup], sequences: list[list[int]], sample_rows: int = 512, batch_size: int = 8,
    seed: int = 0, second_moments: bool = False,
) -> dict[str, InputStats]:  # fmt: skip
    """Run the model over the calibration sequences with a pre-hook on each group's input
    module; keep `sample_rows` token rows per group, drawn evenly from every batch, and with
    `second_moments` accumulate x xᵀ over all tokens (float64: sums of ~16k outer products)."""
    modules = dict(model.named_modules())
    stats: dict[str, InputStats] = {}
    batches = [sequences[i : i + batch_size] for i in range(0, len(sequences), batch_size)]
    per_batch = ceil_div(sample_rows, len(batches))
    generator = torch.Generator().manual_seed(seed)
    picks: list[torch.Tensor] = []

    def hook(group: LinearGroup):
        def record(_module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            entry = stats.get(group.name)
            if entry is None:
                entry = stats[group.name] = InputStats(torch.zeros(x.shape[1]), torch.zeros(x.shape[1]), [])
            entry.abs_sum += x.abs().sum(0)
            entry.abs_max = torch.maximum(entry.abs_max, x.abs().amax(0))
            entry.count += x.shape[0]
            if second_moments:
                outer = (x.T @ x).double()
                entry.outer_sum = outer if entry.outer_sum is None else entry.outer_sum + outer
            entry.rows.append(x[picks[-1]].clone())

        return record

    handles = [modules[g.input_module].register_forward_pre_hook(hook(g)) for g in groups]
    try:
        for batch in batches:
            tokens = torch.tensor(batch)
            picks.append(torch.randperm(tokens.numel(), generator=generator)[:per_batch])
            model(tokens, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return stats
