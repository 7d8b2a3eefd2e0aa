"""EleutherAI's lm-evaluation-harness against an OpenAI-compatible server, as users run it: its CLI
(`lm_eval --model local-completions`, from its own venv: benchmarks/.venvs/lm-eval, made by .ci/setup) on a
multiple-choice loglikelihood task defined here from a file in the repository (the harness's own datasets
cannot be downloaded here). Used by tests/test_lm_eval.py and benchmarks/lm_eval_quality.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LM_EVAL = ROOT / "benchmarks" / ".venvs" / "lm-eval" / "bin" / "lm_eval"
CAPITALS = ROOT / "benchmarks" / "data" / "lm_eval_capitals.jsonl"
TASK = "trtserve_capitals"
PROMPT = "Question: {{question}}\nAnswer:"  # each choice follows after a space (the harness's target delimiter)


@dataclass(frozen=True)
class HarnessRun:
    accuracy: float
    samples: list[dict]  # the harness's: each doc, and each choice's [loglikelihood, is_greedy] in `resps`

    def loglikelihoods(self) -> list[list[float]]:
        """Per question (in the data file's order), each choice's log-likelihood as the harness logged it."""
        ordered = sorted(self.samples, key=lambda s: s["doc_id"])
        return [[float(resp[0][0]) for resp in sample["resps"]] for sample in ordered]


def context(doc: dict) -> str:
    return PROMPT.replace("{{question}}", doc["question"])


def task_folder(folder: Path) -> Path:
    """The task as the harness's YAML, in `folder` (for --include_path)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
        f"task: {TASK}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {CAPITALS}",
        "test_split: test",
        "output_type: multiple_choice",
        f"doc_to_text: {json.dumps(PROMPT)}",
        'doc_to_choice: "{{choices}}"',
        'doc_to_target: "{{answer}}"',
        "metric_list:",
        "  - metric: acc",
    ]
    (folder / f"{TASK}.yaml").write_text("\n".join(lines) + "\n")
    return folder


def run_harness(base_url: str, model: str, tokenizer_dir: Path, out: Path, concurrency: int = 4) -> HarnessRun:
    """The harness's run of the task against `base_url` (a server's root: .../v1/completions is asked), the
    requests tokenized with the tokenizer in `tokenizer_dir` (token-id prompts, the harness's default)."""
    if not LM_EVAL.exists():
        raise RuntimeError(f"{LM_EVAL} is missing: `bash .ci/setup` installs lm-eval in its venv")
    args = ",".join([
        f"model={model}",
        f"base_url={base_url}/v1/completions",
        f"tokenizer={tokenizer_dir}",
        "tokenizer_backend=huggingface",
        f"num_concurrent={concurrency}",
        "max_retries=1",
    ])  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "unused"}
    command = [str(LM_EVAL), "--model", "local-completions", "--model_args", args, "--tasks", TASK,
               "--include_path", str(task_folder(out / "tasks")), "--output_path", str(out / "results"),
               "--log_samples"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    [samples] = list((out / "results").rglob(f"samples_{TASK}_*.jsonl"))
    [results] = list((out / "results").rglob("results_*.json"))
    accuracy = json.loads(results.read_text())["results"][TASK]["acc,none"]
    return HarnessRun(accuracy, [json.loads(line) for line in samples.read_text().splitlines()])
