"""The `llm` model's config.pbtxt parameters -> its settings: the engine directory, the engine's settings (any
EngineArgs field, by name: runtime/engine/engine_args.py), the per-request bounds (Limits, by name) and how
often a request's cancellation is checked. An unknown parameter stops the model loading, naming the allowed
ones: a misspelled setting must not be silently ignored."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from engine_format.requests import Limits
from runtime.engine.engine_args import EngineArgs, from_parameters, served_settings

CANCEL_POLL_S = 0.5  # default of the `cancel_poll_s` parameter
MODEL_PARAMETERS = ("engine_dir", "cancel_poll_s")
LIMIT_PARAMETERS = tuple(f.name for f in dataclasses.fields(Limits))


@dataclass(frozen=True)
class ModelSettings:
    engine_dir: str
    engine: EngineArgs
    limits: dict[str, int]  # Limits given by parameters (the rest: defaults, max_prompt_chars from the engine)
    cancel_poll_s: float  # seconds between a request's is_cancelled() checks; 0: before every response


def model_settings(params: Mapping[str, str]) -> ModelSettings:
    """ValueError naming the parameter for anything not allowed."""
    allowed = (*MODEL_PARAMETERS, *LIMIT_PARAMETERS, *(f.name for f in served_settings()))
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"config parameter '{unknown[0]}' is unknown; allowed: {', '.join(allowed)}")
    engine_dir = params.get("engine_dir", "").strip()
    if not engine_dir:
        raise ValueError("config parameter 'engine_dir' is empty: point it at an engine")
    limits = {k: int(_non_negative(k, params[k])) for k in LIMIT_PARAMETERS if params.get(k, "").strip()}
    poll = params.get("cancel_poll_s", "").strip()
    cancel_poll_s = _non_negative("cancel_poll_s", poll) if poll else CANCEL_POLL_S
    return ModelSettings(engine_dir, from_parameters(params), limits, cancel_poll_s)


def _non_negative(name: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0 <= number < math.inf:
        raise ValueError(f"config parameter '{name}' must be a number >= 0 (got {value!r})")
    return number
