"""EleutherAI's lm-evaluation-harness (`lm-eval` from PyPI, in a venv of its own: .ci/setup makes it) runs a
multiple-choice loglikelihood task through `trtserve serve`'s OpenAI door, as users point it at any
OpenAI-compatible server (`--model local-completions`, which sends echo + logprobs). The task is defined here
from a file in the repository (the harness's own datasets cannot be downloaded here): capitals, four choices.

Every choice's log-likelihood the harness records equals HF eager's for the same model (float32 engine,
1e-3), computed as the harness does (the continuation's tokens are what the whole text's encoding adds to
the context's), and so does its accuracy.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.gateway_helpers import running_gateway
from tests.helpers import FLOAT32_BACKEND, hf_logits
from tests.triton_helpers import running_server

pytestmark = [pytest.mark.slow, pytest.mark.serving]
ROOT = Path(__file__).resolve().parents[1]
LM_EVAL = ROOT / "benchmarks" / ".venvs" / "lm-eval" / "bin" / "lm_eval"
DATA = ROOT / "tests" / "data" / "lm_eval_capitals.jsonl"
MODEL = "smollm2-135m"
TASK = "trtserve_capitals"
PROMPT = "Question: {{question}}\nAnswer:"


def task_yaml(folder: Path) -> Path:
    """The task, as the harness's YAML: the choices follow the prompt after a space (its target delimiter)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
        f"task: {TASK}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {DATA}",
        "test_split: test",
        "output_type: multiple_choice",
        f"doc_to_text: {json.dumps(PROMPT)}",
        'doc_to_choice: "{{choices}}"',
        'doc_to_target: "{{answer}}"',
        "metric_list:",
        "  - metric: acc",
    ]
    path = folder / f"{TASK}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return folder


def run_harness(gateway_url: str, tokenizer_dir: Path, out: Path) -> tuple[list[dict], float]:
    """The harness's samples (each choice's [loglikelihood, is_greedy]) and its accuracy."""
    include = task_yaml(out / "tasks")
    args = ",".join([
        f"model={MODEL}",
        f"base_url={gateway_url}/v1/completions",
        f"tokenizer={tokenizer_dir}",
        "tokenizer_backend=huggingface",
        "num_concurrent=4",
        "max_retries=1",
    ])  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "unused"}
    command = [str(LM_EVAL), "--model", "local-completions", "--model_args", args, "--tasks", TASK,
               "--include_path", str(include), "--output_path", str(out / "results"), "--log_samples"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [samples] = list((out / "results").rglob(f"samples_{TASK}_*.jsonl"))
    [results] = list((out / "results").rglob("results_*.json"))
    accuracy = json.loads(results.read_text())["results"][TASK]["acc,none"]
    return [json.loads(line) for line in samples.read_text().splitlines()], accuracy


def hf_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """The harness's split: the continuation's tokens are those the whole text's encoding adds to the context's."""
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    start = len(tokenizer.encode(context, add_special_tokens=False))
    logprobs = torch.log_softmax(torch.from_numpy(hf_logits(model, whole)).double(), dim=-1).numpy()
    return float(sum(logprobs[i - 1, whole[i]] for i in range(start, len(whole))))


def test_lm_eval_loglikelihoods_equal_hf(smollm2_engine, smollm2_hf, tmp_path):
    assert LM_EVAL.exists(), f"{LM_EVAL} is missing: `bash .ci/setup` installs lm-eval in its venv"
    with (
        running_server(smollm2_engine, {"backend": FLOAT32_BACKEND}) as triton,
        running_gateway(triton.config.grpc_port, MODEL) as gateway,
    ):
        samples, accuracy = run_harness(gateway.url, smollm2_engine, tmp_path)
    model, tokenizer = smollm2_hf
    assert len(samples) == len(DATA.read_text().splitlines())
    right = 0
    for sample in samples:
        doc = sample["doc"]
        context = PROMPT.replace("{{question}}", doc["question"])
        got = [float(resp[0][0]) for resp in sample["resps"]]  # the harness logs each choice's [loglik, greedy]
        want = [hf_loglikelihood(model, tokenizer, context, " " + choice) for choice in doc["choices"]]
        np.testing.assert_allclose(got, want, atol=1e-3, err_msg=doc["question"])
        right += int(np.argmax(want) == doc["answer"])
    assert accuracy == pytest.approx(right / len(samples))
    assert accuracy > 0.5  # the model knows most capitals: the scores are not noise
