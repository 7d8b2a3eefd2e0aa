"""`python -m benchmarks.routing`: model routing through the real gateway -> results/routing.{json,md,png}.

Two tritonservers, the INT4-AWQ engine (`small`) and the fp32 engine (`strong`), behind one gateway
whose YAML config names both backends and a virtual model `auto`: policy cascade (small answers;
below `cascade_threshold` mean token logprob, strong answers instead). Questions with known answers:
calibration/qa_prompts.json (the quantization gate's; kept there because fp32 answers them, so
strong-only is right on all of them by construction) plus data/held_out_questions.json (written for this
benchmark, filtered by no model). Judged as calibration/gate.py does: correct when the answer
contains a listed string (case-insensitive); chat template, greedy, at most 32 tokens.

The curve over the threshold needs one pass: every question asked of `small` (with logprobs) and
of `strong`. Greedy answers are deterministic, so at threshold t the cascade answers question i
with strong exactly when small's mean logprob is below t (runtime/gateway/exchange.py's rule), and
accuracy and cost follow for every t. The measured `auto` runs check that prediction.

    python -m benchmarks.routing --small /work/engines/smollm2-135m-int4-awq --strong /work/engines/smollm2-135m-b32
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import click
import yaml

from benchmarks import plots, servers
from benchmarks.cpu import wait_quiet
from benchmarks.prometheus import scrape
from benchmarks.report import RESULTS_DIR, cpu_busy_fraction, write_report
from calibration.data import QA_FILE

ANSWER_TOKENS = 32  # calibration/gate.py ANSWER_TOKENS
SYSTEMS = ("small", "strong", "auto")  # model names the client asks for
HELD_OUT = Path(__file__).parent / "data" / "held_out_questions.json"  # written for this benchmark


def questions() -> list[dict]:
    qa = [{"set": "qa", "question": q["question"], "answers": q["answers"]} for q in json.loads(QA_FILE.read_text())
          ["prompts"]]  # fmt: skip
    held_out = json.loads(HELD_OUT.read_text())["questions"]
    return qa + [{"set": "held-out", "question": q["question"], "answers": q["answers"]} for q in held_out]


def correct(text: str, answers: list[str]) -> bool:
    return any(a.lower() in text.lower() for a in answers)  # calibration/gate.py's rule


async def ask_all(url: str, model: str, items: list[dict], concurrency: int, logprobs: bool = False
                  ) -> tuple[list[dict], float]:  # fmt: skip
    """Every question once (non-streaming chat, greedy); answers in order, and the wall time."""
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one(item: dict) -> dict:
            body = {"model": model, "messages": [{"role": "user", "content": item["question"]}],
                    "max_tokens": ANSWER_TOKENS, "temperature": 0.0, "logprobs": logprobs}  # fmt: skip
            async with gate, session.post(f"{url}/v1/chat/completions", json=body) as resp:
                data = await resp.json()
            if resp.status != 200:
                return {"error": f"HTTP {resp.status}: {str(data)[:200]}", "correct": False, "tokens": 0}
            choice = data["choices"][0]
            lps = [t["logprob"] for t in (choice.get("logprobs") or {}).get("content") or []]
            text = choice["message"]["content"]
            mean = sum(lps) / len(lps) if lps else None  # over every generated token, as exchange.py takes it
            return {"answer": text, "model": data["model"], "tokens": data["usage"]["completion_tokens"],
                    "correct": correct(text, item["answers"]), "mean_logprob": mean}  # fmt: skip

        start = time.perf_counter()
        answers = await asyncio.gather(*(one(i) for i in items))
        return list(answers), time.perf_counter() - start


def cascade_curve(items: list[dict]) -> list[dict]:
    """Accuracy and cost of the cascade at every threshold that changes its decisions.

    `items`: per question small_correct, strong_correct, small_tokens, strong_tokens and
    small_mean_logprob. Escalating the k least confident answers is one point, at the threshold
    halfway between the k-th and (k+1)-th mean logprob (exchange.py escalates when mean < t)."""
    order = sorted(items, key=lambda i: i["small_mean_logprob"])
    values = [i["small_mean_logprob"] for i in order]
    small_tokens = sum(i["small_tokens"] for i in items)
    points = []
    for k in range(len(order) + 1):
        lo, hi = (values[k - 1] if k else -math.inf), (values[k] if k < len(order) else 0.0)
        if k and k < len(order) and lo == hi:
            continue  # ties escalate together
        strong = sum(i["strong_tokens"] for i in order[:k])
        right = sum(i["strong_correct"] for i in order[:k]) + sum(i["small_correct"] for i in order[k:])
        threshold = max(hi, -99.0) if not k else hi if k == len(order) else (lo + hi) / 2  # -99: none escalates
        points.append({"threshold": round(threshold, 4),
                       "escalated": round(k / len(order), 4), "accuracy": round(right / len(order), 4),
                       "strong_token_share": round(strong / max(small_tokens + strong, 1), 4)})  # fmt: skip
    return points


def run_summary(answers: list[dict], wall_s: float, generated: dict[str, float], items: list[dict]) -> dict:
    """One measured run of one system: accuracy (all and per set), cost, speed."""
    out: dict = {"accuracy": round(statistics.mean(a["correct"] for a in answers), 4)}
    for name in ("qa", "held-out"):
        out[f"accuracy_{name}"] = round(statistics.mean(a["correct"] for a, i in zip(answers, items, strict=True)
                                                        if i["set"] == name), 4)  # fmt: skip
    delivered, small, strong = sum(a["tokens"] for a in answers), generated["small"], generated["strong"]
    out |= {"errors": sum("error" in a for a in answers), "answer_tokens": delivered,
            "answer_tok_s": round(delivered / wall_s, 2), "questions_s": round(len(answers) / wall_s, 3),
            "wall_s": round(wall_s, 2), "escalated": round(statistics.mean(a.get("model") == "strong" for a in answers),
                                                           4),
            "generated_small": small, "generated_strong": strong,
            "strong_token_share": round(strong / max(small + strong, 1), 4)}  # fmt: skip
    return out


def render(p: dict) -> str:
    m, cell = p["machine"], lambda row, k, d=3: _cell(row, k, d)
    lines = ["# Model routing through the gateway (issue 14)", "",
             f"Machine: {m['cpu']}, {m['cores']} cores; run {p['date_utc']}, {p['wall_s']:.0f} s wall. "
             f"Command: `{p['command']}`. CPU busy before: {p['cpu_busy_before']}.", "",
             "Controls: " + "; ".join(p["controls"]), "",
             "## Measured through the gateway (median, min–max over repetitions)", "",
             "| system | accuracy | qa | held-out | strong-token share | escalated | answer tok/s | questions/s "
             "| generated small / strong | errors |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, row in p["measured"].items():
        lines.append(f"| {name} | {cell(row, 'accuracy')} | {cell(row, 'accuracy_qa')} | "
                     f"{cell(row, 'accuracy_held-out')} | {cell(row, 'strong_token_share')} | {cell(row, 'escalated')}"
                     f" | {cell(row, 'answer_tok_s', 1)} | {cell(row, 'questions_s', 2)} | "
                     f"{row['median']['generated_small']:.0f} / {row['median']['generated_strong']:.0f} | "
                     f"{row['median']['errors']:.0f} |")  # fmt: skip
    c = p["check"]
    lines += ["", f"Offline prediction vs the gateway's `auto` at threshold {p['threshold']}: {c['agree']}/{c['n']} "
              f"questions routed as predicted in every repetition; predicted accuracy {c['predicted_accuracy']}, "
              f"escalated {c['predicted_escalated']}.",
              f"Gateway token accounting over the whole run: trtserve_gateway_tokens_total completion for small = "
              f"{p['accounting']['gateway_small']:.0f}, for strong = {p['accounting']['gateway_strong']:.0f}; the "
              f"tritonservers generated small = {p['accounting']['triton_small']:.0f}, strong = "
              f"{p['accounting']['triton_strong']:.0f}.", "",
              "## Cascade curve (offline, all questions; Pareto points)", "",
              "| threshold | escalated | accuracy | strong-token share |", "|---|---|---|---|"]  # fmt: skip
    best = -1.0
    for q in p["curves"]["all"]:
        if q["accuracy"] > best:
            best = q["accuracy"]
            lines.append(f"| {q['threshold']} | {q['escalated']:.3f} | {q['accuracy']:.3f} | "
                         f"{q['strong_token_share']:.3f} |")  # fmt: skip
    versions = ", ".join(f"{k} {v}" for k, v in p["versions"].items() if v)
    return "\n".join([*lines, "", "## Versions", "", versions, ""])


def _cell(row: dict, key: str, digits: int) -> str:
    med, (lo, hi) = row["median"][key], row["spread"][key]
    return f"{med:.{digits}f}" + (f" ({lo:.{digits}f}–{hi:.{digits}f})" if hi > lo else "")


@contextlib.contextmanager
def gateway(small: Path, strong: Path, threshold: float, logs: Path) -> Iterator[tuple[str, dict[str, str], dict]]:
    """Two tritonservers and a gateway whose config names both: (gateway URL, engine metrics URLs, config)."""
    from runtime.gateway.process import GatewayProcess
    from runtime.serve.launcher import ServerConfig, TritonServer, free_port

    settings = servers.ServingSettings(max_num_seqs=16, kv_tokens=16 * 1024, max_model_len=1024)
    configs = {k: ServerConfig.on_free_ports(e, engine_params=servers.trtserve_params(e, settings))
               for k, e in (("small", small), ("strong", strong))}  # fmt: skip
    config = {"backends": {k: {"url": f"127.0.0.1:{c.grpc_port}"} for k, c in configs.items()},
              "virtual_models": {"auto": {"policy": "cascade", "small": "small", "strong": "strong",
                                          "cascade_threshold": threshold}}}  # fmt: skip
    (logs / "gateway.yaml").write_text(yaml.safe_dump(config))
    with contextlib.ExitStack() as stack:
        for k, c in configs.items():
            stack.enter_context(TritonServer(c, logs / f"triton-{k}.log")).wait_ready()
        gw = stack.enter_context(GatewayProcess(["--config", str(logs / "gateway.yaml")], "127.0.0.1", free_port(),
                                                log_path=logs / "gateway.log"))  # fmt: skip
        gw.wait_ready()
        yield gw.url, {k: f"http://127.0.0.1:{c.metrics_port}/metrics" for k, c in configs.items()}, config


def measure(url: str, metrics: dict[str, str], items: list[dict], concurrency: int, repetitions: int, log
            ) -> tuple[dict[str, list[dict]], list[list[bool]]]:  # fmt: skip
    """Each system over every question per repetition, in rotating order; cost from the engines' counters."""
    generated = lambda: {k: scrape(u, "trtserve_generation_tokens_total") for k, u in metrics.items()}  # noqa: E731
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    routed: list[list[bool]] = []  # auto: which questions strong answered, per repetition
    for rep in range(repetitions):
        wait_quiet(log)
        for system in SYSTEMS[rep % 3 :] + SYSTEMS[: rep % 3]:
            time.sleep(1.2)  # the engines refresh their counters every 0.5 s
            before = generated()
            answers, wall = asyncio.run(ask_all(url, system, items, concurrency))
            time.sleep(1.2)
            runs[system].append(run_summary(answers, wall, {k: v - before[k] for k, v in generated().items()}, items))
            if system == "auto":
                routed.append([a.get("model") == "strong" for a in answers])
            log(f"{system} rep {rep}: {runs[system][-1]}")
    return runs, routed


def per_question(items: list[dict], small: list[dict], strong: list[dict]) -> list[dict]:
    """The curve pass's answers side by side (an unknown mean logprob escalates, as in the gateway)."""
    return [{**i, "small_answer": s.get("answer"), "small_tokens": s["tokens"], "small_correct": s["correct"],
             "small_mean_logprob": -math.inf if s.get("mean_logprob") is None else s["mean_logprob"],
             "strong_answer": g.get("answer"), "strong_tokens": g["tokens"], "strong_correct": g["correct"]}
            for i, s, g in zip(items, small, strong, strict=True)]  # fmt: skip


def check(per_q: list[dict], routed: list[list[bool]], threshold: float) -> dict:
    predicted = [q["small_mean_logprob"] < threshold for q in per_q]
    right = [q["strong_correct"] if e else q["small_correct"] for q, e in zip(per_q, predicted, strict=True)]
    return {"n": len(per_q), "agree": sum(all(r[i] == e for r in routed) for i, e in enumerate(predicted)),
            "predicted_escalated": round(statistics.mean(predicted), 4),
            "predicted_accuracy": round(statistics.mean(right), 4)}  # fmt: skip


@click.command()
@click.option("--small", type=click.Path(exists=True, path_type=Path), default="engines/smollm2-135m-int4-awq")
@click.option("--strong", type=click.Path(exists=True, path_type=Path), default="engines/smollm2-135m-b32")
@click.option("--threshold", default=-0.8, show_default=True, help="auto's cascade_threshold (mean token logprob).")
@click.option("--concurrency", default=4, show_default=True)
@click.option("--repetitions", default=3, show_default=True, type=click.IntRange(1))
@click.option("--name", default="routing", show_default=True)
def main(small: Path, strong: Path, threshold: float, concurrency: int, repetitions: int, name: str) -> None:
    logs, items, log = RESULTS_DIR / "logs" / name, questions(), lambda s: click.echo(s, err=True)
    logs.mkdir(parents=True, exist_ok=True)
    busy, started = cpu_busy_fraction(), time.time()
    with gateway(small, strong, threshold, logs) as (url, metrics, config):
        for model in SYSTEMS:  # warm-up: every path once
            asyncio.run(ask_all(url, model, items[:2], 2))
        log("curve pass: every question to small (with logprobs) and to strong")
        per_q = per_question(items, asyncio.run(ask_all(url, "small", items, concurrency, True))[0],
                             asyncio.run(ask_all(url, "strong", items, concurrency))[0])  # fmt: skip
        runs, routed = measure(url, metrics, items, concurrency, repetitions, log)
        time.sleep(1.2)
        gw_tokens = {m: scrape(f"{url}/metrics", "trtserve_gateway_tokens_total", f'model="{m}"', 'kind="completion"')
                     for m in ("small", "strong")}  # fmt: skip
        accounting = {f"gateway_{m}": v for m, v in gw_tokens.items()}
        accounting |= {f"triton_{k}": scrape(u, "trtserve_generation_tokens_total") for k, u in metrics.items()}
    payload = {
        "command": "python -m benchmarks.routing " + shlex.join(sys.argv[1:]), "cpu_busy_before": busy,
        "threshold": threshold, "config": config, "wall_s": round(time.time() - started, 1),
        "controls": [f"small = {small} (INT4-AWQ), strong = {strong} (fp32), one tritonserver each (max 16 "
                     "sequences, 16,384 KV tokens, prefix caching on), one gateway (`trtserve gateway --config`)",
                     f"{len(items)} questions: {sum(q['set'] == 'qa' for q in items)} from "
                     f"calibration/qa_prompts.json, {sum(q['set'] == 'held-out' for q in items)} held-out "
                     f"(benchmarks/data/held_out_questions.json); chat, greedy, <= {ANSWER_TOKENS} tokens",
                     f"non-streaming requests (the gateway cascades only those), {concurrency} in flight",
                     f"{repetitions} repetitions, systems in rotating order; a warm-up of 2 questions per model",
                     "cost = tokens the two tritonservers generated (their trtserve_generation_tokens_total), "
                     "so a cascade's discarded small answers count",
                     "curve: one pass (small with logprobs, strong), cascade decisions replayed per threshold"],
        "measured": {s: {"reps": r, "median": {k: statistics.median(x[k] for x in r) for k in r[0]},
                         "spread": {k: [min(x[k] for x in r), max(x[k] for x in r)] for k in r[0]}}
                     for s, r in runs.items()},
        "curves": {"all": cascade_curve(per_q), **{s: cascade_curve([q for q in per_q if q["set"] == s])
                                                    for s in ("qa", "held-out")}},
        "check": check(per_q, routed, threshold), "accounting": accounting, "questions": per_q,
    }  # fmt: skip
    md, full = write_report(name, payload, render)
    plots.routing_quality_cost(full, RESULTS_DIR / f"{name}_quality_cost.png")
    click.echo(md.read_text())


if __name__ == "__main__":
    main()
