"""The deploy quality gate: a quantized engine against its unquantized reference, on ORT CPU.

Both engines run on the held-out set (teacher-forced, every position scored) and on
questions with known answers (greedy). Metrics:
- perplexity of each engine and the relative increase of the quantized one;
- mean KL(reference || quantized) of the next-token distributions;
- top-1 agreement: positions where both engines' most likely next token is the same;
- greedy answers: of the questions the reference answers correctly, the share the quantized
  engine also answers correctly; and the share of identical answers (reported).
Thresholds live in a versioned JSON config (gate_v1.json); `passed` needs every check.

The quantized engine runs with its KV cache dtype (engine_format/kv_cache.py), so an int8/fp8
KV cache is scored like a weight format: on its own (KV-only engines, thresholds "kv-int8" /
"kv-fp8", against the same engine with a model-dtype cache) or together with quantized weights
(the weight method's thresholds then judge both). The report names the KV dtype.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from calibration.data import TextSets
from engine_format import ceil_div
from executors.base import SequenceChunk
from executors.greedy import greedy_generate

DEFAULT_GATE_CONFIG = Path(__file__).with_name("gate_v1.json")
QUESTION_TOKENS = 128  # a question's prompt is cut to this many tokens
ANSWER_TOKENS = 32


def gate_method(config) -> str:
    """The thresholds an engine is judged by: its weight method's, else its KV dtype's ("kv-int8")."""
    if config.quantization:
        return config.quantization
    if config.kv_quantized:
        return f"kv-{config.kv_cache_dtype}"
    raise ValueError(f"{config.engine_dir} is not quantized (weights or KV cache): nothing to gate")


@dataclass
class GateReport:
    method: str
    config_version: int
    metrics: dict
    checks: dict[str, dict] = field(default_factory=dict)
    kv_cache_dtype: str = "auto"  # the quantized engine's KV cache while it was scored

    @property
    def passed(self) -> bool:
        return all(c["passed"] for c in self.checks.values())

    def to_dict(self) -> dict:
        return {"method": self.method, "kv_cache_dtype": self.kv_cache_dtype,
                "gate_config_version": self.config_version, "passed": self.passed,
                "checks": self.checks, "metrics": self.metrics}  # fmt: skip

    def table(self) -> str:
        """A markdown table: one row per check."""
        verdict = "PASSED" if self.passed else "FAILED"
        title = f"Quality gate v{self.config_version} for {self.method} (KV cache {self.kv_cache_dtype}): {verdict}"
        lines = [title, "",
                 "| check | value | threshold | result |", "|---|---|---|---|"]  # fmt: skip
        for name, check in self.checks.items():
            op = "<=" if check["kind"] == "max" else ">="
            result = "pass" if check["passed"] else "FAIL"
            lines.append(f"| {name} | {check['value']:.4f} | {op} {check['threshold']} | {result} |")
        m = self.metrics
        lines += [
            "",
            f"perplexity: reference {m['reference_perplexity']:.3f}, quantized {m['quantized_perplexity']:.3f} "
            f"over {m['heldout_tokens']} held-out tokens",
            f"known answers: reference {m['reference_correct']}/{m['questions']}, quantized "
            f"{m['quantized_correct']}/{m['questions']}; identical answers: {m['answers_identical']:.2f}",
        ]
        return "\n".join(lines)


def load_gate_config(path: Path | None = None) -> dict:
    path = path or DEFAULT_GATE_CONFIG
    try:
        config = json.loads(Path(path).read_text())
        config["version"], config["thresholds"]  # required keys
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"gate config {path}: {exc}") from None
    return config


def run_gate(reference_config, quantized_config, texts: TextSets, tokenizer, config_path: Path | None = None):
    """Load both engines on the CPU backend (segments + paged-attention kernel) and evaluate."""
    from executors import create_backend

    num_blocks = _gate_blocks(texts, reference_config.block_size)
    reference = create_backend(reference_config, num_blocks=num_blocks, kind="cpu")
    quantized = create_backend(quantized_config, num_blocks=num_blocks, kind="cpu")
    return evaluate_gate(
        reference, quantized, gate_method(quantized_config), texts, tokenizer, load_gate_config(config_path)
    )


def run_backend_gate(engine_config, kind: str, texts: TextSets, tokenizer, config_path: Path | None = None):
    """A backend that quantizes a float32 engine as it loads (cpu-int8) against the float32 CPU backend on the
    same engine, judged by the thresholds named after the backend."""
    from executors import create_backend

    num_blocks = _gate_blocks(texts, engine_config.block_size)
    reference = create_backend(engine_config, num_blocks=num_blocks, kind="cpu")
    candidate = create_backend(engine_config, num_blocks=num_blocks, kind=kind)
    return evaluate_gate(reference, candidate, kind, texts, tokenizer, load_gate_config(config_path))


def _gate_blocks(texts: TextSets, block: int) -> int:
    """Greedy answers hold every question at once; held-out scoring one sequence at a time."""
    longest = max(len(s) for s in texts.heldout)
    return max(ceil_div(longest, block), len(texts.qa_prompts) * ceil_div(QUESTION_TOKENS + ANSWER_TOKENS, block))


def evaluate_gate(reference, quantized, method: str, texts: TextSets, tokenizer, config: dict) -> GateReport:
    """`reference`, `quantized`: OrtCpuBackend-like objects (prompt_logits, step, config, num_blocks);
    the quantized one runs with its own KV cache dtype."""
    thresholds = config["thresholds"].get(method)
    if thresholds is None:
        raise ValueError(f"gate config v{config['version']} has no thresholds for {method!r}")
    max_len = reference.config.max_seq_len  # an engine built for short sequences scores them cut to its length
    metrics = _heldout_metrics(reference, quantized, [s[:max_len] for s in texts.heldout])
    metrics.update(
        _answer_metrics(
            reference, quantized, texts.qa_prompts, tokenizer, min(QUESTION_TOKENS, max_len - ANSWER_TOKENS)
        )
    )
    values = {
        "perplexity_increase": metrics["quantized_perplexity"] / metrics["reference_perplexity"] - 1,
        "mean_kl": metrics["mean_kl"],
        "top1_agreement": metrics["top1_agreement"],
        "answer_retention": metrics["answer_retention"],
    }
    checks = {}
    for name, value in values.items():
        kind, threshold = ("max", thresholds[f"max_{name}"]) if f"max_{name}" in thresholds else (
            "min", thresholds[f"min_{name}"])  # fmt: skip
        ok = value <= threshold if kind == "max" else value >= threshold
        checks[name] = {"value": float(value), "threshold": threshold, "kind": kind, "passed": bool(ok)}
    return GateReport(method, config["version"], metrics, checks, quantized.config.kv_cache_dtype)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _heldout_metrics(reference, quantized, sequences: list[list[int]]) -> dict:
    nll = {"reference": 0.0, "quantized": 0.0}
    kl_sum, agree, count = 0.0, 0, 0
    for tokens in sequences:
        table = list(range(ceil_div(len(tokens), reference.config.block_size)))
        chunk = SequenceChunk(tokens, 0, table)
        ref = _log_softmax(reference.prompt_logits(chunk)[:-1].astype(np.float64))
        qnt = _log_softmax(quantized.prompt_logits(chunk)[:-1].astype(np.float64))
        targets = np.asarray(tokens[1:])
        rows = np.arange(len(targets))
        nll["reference"] -= ref[rows, targets].sum()
        nll["quantized"] -= qnt[rows, targets].sum()
        kl_sum += float((np.exp(ref) * (ref - qnt)).sum())
        agree += int((ref.argmax(-1) == qnt.argmax(-1)).sum())
        count += len(targets)
    return {
        "heldout_sequences": len(sequences),
        "heldout_tokens": count,
        "reference_perplexity": float(np.exp(nll["reference"] / count)),
        "quantized_perplexity": float(np.exp(nll["quantized"] / count)),
        "mean_kl": kl_sum / count,
        "top1_agreement": agree / count,
    }


def _question_tokens(tokenizer, question: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": question}]
        return list(
            tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        )
    return tokenizer.encode(question)


def _answer_metrics(reference, quantized, qa_prompts: list[dict], tokenizer, question_tokens: int) -> dict:
    prompts = [_question_tokens(tokenizer, q["question"])[:question_tokens] for q in qa_prompts]
    eos = set(reference.config.model.eos_token_ids)
    texts = {}
    for name, backend in (("reference", reference), ("quantized", quantized)):
        # Every question in one batch (beyond the engine's max_batch_size: the CPU backend takes
        # any batch), each prompt prefilled on its own, then batched decode steps.
        answers = greedy_generate(backend, prompts, ANSWER_TOKENS, eos, prefill_batch=1, max_batch_size=len(prompts))
        texts[name] = [tokenizer.decode(t, skip_special_tokens=True) for t in answers]
    pairs = list(zip(qa_prompts, texts["reference"], texts["quantized"], strict=True))

    def correct(text: str, qa: dict) -> bool:
        return any(a.lower() in text.lower() for a in qa["answers"])

    reference_ok = [i for i, (qa, ref, _) in enumerate(pairs) if correct(ref, qa)]
    kept = [i for i in reference_ok if correct(pairs[i][2], pairs[i][0])]
    return {
        "questions": len(pairs),
        "reference_correct": len(reference_ok),
        "quantized_correct": sum(correct(q, qa) for qa, _, q in pairs),
        "answer_retention": len(kept) / len(reference_ok) if reference_ok else 1.0,  # vacuous when none is known
        "answers_identical": float(np.mean([ref == q for _, ref, q in pairs])),
        "answers": [{"question": qa["question"], "reference": ref, "quantized": q} for qa, ref, q in pairs],
    }
