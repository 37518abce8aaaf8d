"""Stage `evaluate`: acceptance of the drafter offline (our decoder) and in the real engine (vLLM).

The offline evaluator uses the aux layer ids and vocabulary map the drafter was TRAINED with
(the hidden store's manifest and artifacts/vocab), while vLLM reads what the exported checkpoint
says. The two agree only if the export is right: a checkpoint with shifted aux ids or without its
d2t is served badly by vLLM and the agreement check fails loudly, before anyone deploys it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow.parquet as pq
import torch

from stages import server
from stages.atomic import atomic_write_json
from stages.checkpoint import load_drafter
from stages.generate import render
from stages.metrics import write_metrics
from stages.params import load_section
from stages.speculative import DecodeStats, SpecDecoder
from stages.target import load_record

TARGET_DIR, DRAFTER_DIR = Path("artifacts/target"), Path("artifacts/drafter")
EVAL_PROMPTS, VOCAB_DIR = Path("artifacts/prompts/eval.parquet"), Path("artifacts/vocab")
MANIFEST = Path("artifacts/hidden/manifest.json")
STATE_DIR = Path("run/server-eval")
METRIC = re.compile(r'^(vllm:spec_decode_num_(?:drafts|draft_tokens|accepted_tokens|accepted_tokens_per_pos)_total)'
                    r'\{([^}]*)\}\s+([0-9.eE+-]+)$')


@dataclass
class EvaluateParams:
    num_speculative_tokens: int = 3
    temperature: float = 0.0
    max_new_tokens: int = 256
    num_questions: int = 80  # MT-bench questions, both turns each
    offline: bool = True
    online: bool = True
    concurrency: int = 8
    throughput_prompts: int = 8  # prompts timed at batch 1 and at `concurrency`, with and without the drafter
    measure_baseline: bool = True  # also serve the target alone for the throughput comparison
    agreement_tolerance: float = 0.10  # |offline - vLLM| / vLLM acceptance length, at temperature 0
    seed: int = 0
    port: int = 8010


def questions(n: int) -> list[dict[str, Any]]:
    return pq.read_table(EVAL_PROMPTS).to_pylist()[:n]


def conversation(turns: list[str], answers: list[str]) -> list[dict[str, str]]:
    """The user's turns with the model's own earlier answers between them."""
    messages = []
    for i, turn in enumerate(turns[: len(answers) + 1]):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def offline_eval(params: EvaluateParams, record: dict, tokenizer: Any, items: list[dict]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(record["model_path"], dtype=torch.float32).eval()
    drafter = load_drafter(DRAFTER_DIR)
    drafter.d2t = torch.from_numpy(np.load(VOCAB_DIR / "d2t.npy"))  # the map it was trained with
    aux_ids = json.loads(MANIFEST.read_text())["aux_layer_ids"]
    decoder = SpecDecoder(target, drafter, aux_ids, params.num_speculative_tokens, params.temperature,
                          torch.Generator().manual_seed(params.seed))
    eos = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")} - {None}
    total, per_category = DecodeStats(), defaultdict(DecodeStats)
    for number, item in enumerate(items, start=1):
        answers: list[str] = []
        for _ in item["turns"]:
            ids, stats = decoder.generate(render(tokenizer, conversation(item["turns"], answers), True),
                                          params.max_new_tokens, eos)
            answers.append(tokenizer.decode(ids, skip_special_tokens=True))
            total.add(stats)
            per_category[item["category"]].add(stats)
        print(f"[evaluate offline] {number}/{len(items)} questions, acceptance length "
              f"{total.acceptance_length():.3f}", file=sys.stderr, flush=True)
    return {"acceptance_length": total.acceptance_length(),
            "per_position": [a / total.rounds for a in total.accepted_per_pos],
            "rounds": total.rounds, "generated": total.generated,
            "per_category": {c: round(s.acceptance_length(), 4) for c, s in sorted(per_category.items())}}


def scrape(url: str) -> dict[str, float]:
    return parse_spec_metrics(httpx.get(f"{url}/metrics", timeout=30).text)


def parse_spec_metrics(text: str) -> dict[str, float]:
    """Spec-decode counters of a Prometheus page, summed over engines; per position keyed 'pos<i>'."""
    totals: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        match = METRIC.match(line)
        if match:
            name, labels, value = match.groups()
            position = re.search(r'position="(\d+)"', labels)
            totals[f"pos{position.group(1)}" if position else name.split("num_")[1].removesuffix("_total")] += float(value)
    return totals


async def chat(client: httpx.AsyncClient, url: str, messages: list[dict], params: EvaluateParams) -> dict[str, Any]:
    response = await client.post(f"{url}/v1/chat/completions", timeout=1800, json={
        "model": "target", "messages": messages, "temperature": params.temperature,
        "max_tokens": params.max_new_tokens, "seed": params.seed})
    response.raise_for_status()
    return response.json()


async def answer_all(url: str, items: list[dict], params: EvaluateParams, concurrency: int) -> list[list[str]]:
    """Every question's turns, each later turn conditioned on the engine's own answers."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient() as client:
        async def one(item: dict) -> list[str]:
            answers: list[str] = []
            for _ in item["turns"]:
                async with limit:
                    body = await chat(client, url, conversation(item["turns"], answers), params)
                answers.append(body["choices"][0]["message"]["content"] or "")
            return answers
        return await asyncio.gather(*(one(item) for item in items))


def generation_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def output_tokens_per_s(url: str, items: list[dict], params: EvaluateParams, concurrency: int) -> float:
    """Generated tokens per second over the first turns of `items`, `concurrency` requests at a time."""
    first_turns = [{**item, "turns": item["turns"][:1]} for item in items]
    before, start = generation_tokens(url), time.monotonic()
    asyncio.run(answer_all(url, first_turns, params, concurrency))
    return (generation_tokens(url) - before) / (time.monotonic() - start)


def serve(params: EvaluateParams, record: dict, speculative: bool) -> server.ServerState:
    extra = ["--speculative-config", json.dumps({"method": "eagle3", "model": str(DRAFTER_DIR.resolve()),
                                                  "num_speculative_tokens": params.num_speculative_tokens})]
    serve_params = dataclasses.replace(load_section("serve", server.ServeParams), port=params.port,
                                       extra_args=extra if speculative else [])
    return server.start(serve_params, record, state_dir=STATE_DIR)


def throughput(url: str, items: list[dict], params: EvaluateParams) -> dict[str, float]:
    timed = items[: params.throughput_prompts]
    return {"batch1_tokens_per_s": round(output_tokens_per_s(url, timed, params, 1), 2),
            f"concurrency{params.concurrency}_tokens_per_s": round(output_tokens_per_s(url, timed, params,
                                                                                      params.concurrency), 2)}


def online_eval(params: EvaluateParams, record: dict, items: list[dict]) -> dict[str, Any]:
    """The same questions through vLLM serving target + drafter; acceptance read from /metrics."""
    state = serve(params, record, speculative=True)
    try:
        before = scrape(state.url)
        asyncio.run(answer_all(state.url, items, params, params.concurrency))
        after = scrape(state.url)
        with_drafter = throughput(state.url, items, params)
    finally:
        server.stop(STATE_DIR)
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    result = {"acceptance_length": 1 + accepted / drafts if drafts else 0.0, "drafts": drafts,
              "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
              "per_position": [(after[f"pos{i}"] - before.get(f"pos{i}", 0)) / drafts if drafts else 0.0
                               for i in range(params.num_speculative_tokens)],
              "throughput_with_drafter": with_drafter}
    if params.measure_baseline:
        state = serve(params, record, speculative=False)
        try:
            result["throughput_without_drafter"] = throughput(state.url, items, params)
        finally:
            server.stop(STATE_DIR)
    return result


def agreement_failure(offline: dict, online: dict, tolerance: float) -> str | None:
    gap = abs(offline["acceptance_length"] - online["acceptance_length"]) / max(online["acceptance_length"], 1e-9)
    if gap <= tolerance:
        return None
    curves = "\n".join(f"  position {i}: offline {o:.3f}  vLLM {v:.3f}"
                        for i, (o, v) in enumerate(zip(offline["per_position"], online["per_position"])))
    return (f"offline acceptance length {offline['acceptance_length']:.3f} and vLLM's {online['acceptance_length']:.3f} "
            f"differ by {gap:.1%} (> {tolerance:.0%}): the engine does not serve the drafter that was trained "
            f"(aux layer ids, vocab map or weights in the export). Per position:\n{curves}")


def main() -> None:
    from transformers import AutoTokenizer

    start = time.monotonic()
    server.require_accelerators_free("evaluate")
    params = load_section("evaluate", EvaluateParams)
    record = load_record(TARGET_DIR)
    tokenizer = AutoTokenizer.from_pretrained(TARGET_DIR)
    items = questions(params.num_questions)
    offline = offline_eval(params, record, tokenizer, items) if params.offline else None
    online = online_eval(params, record, items) if params.online else None
    failure = (agreement_failure(offline, online, params.agreement_tolerance)
               if offline and online and params.temperature == 0 else None)
    wall = time.monotonic() - start
    metrics = {"num_draft_tokens": params.num_speculative_tokens, "temperature": params.temperature,
               "questions": len(items),
               "offline_acceptance_length": round(offline["acceptance_length"], 4) if offline else None,
               "offline_acceptance_per_position": [round(x, 4) for x in offline["per_position"]] if offline else None,
               "offline_per_category": offline["per_category"] if offline else None,
               "vllm_acceptance_length": round(online["acceptance_length"], 4) if online else None,
               "vllm_acceptance_per_position": [round(x, 4) for x in online["per_position"]] if online else None,
               "vllm_drafts": online["drafts"] if online else None,
               "throughput_with_drafter": online["throughput_with_drafter"] if online else None,
               "throughput_without_drafter": (online or {}).get("throughput_without_drafter"),
               "agreement": failure is None}
    write_metrics("evaluate", wall, items=len(items), tokens=offline["generated"] if offline else 0, **metrics)
    atomic_write_json(Path("metrics/evaluate_positions.json"), [
        {"position": i, "offline": (offline or {}).get("per_position", [None] * (i + 1))[i],
         "vllm": (online or {}).get("per_position", [None] * (i + 1))[i]} for i in range(params.num_speculative_tokens)])
    print(f"evaluate: acceptance length at k={params.num_speculative_tokens}, T={params.temperature}: offline "
          f"{metrics['offline_acceptance_length']}, vLLM {metrics['vllm_acceptance_length']} on {len(items)} "
          f"questions; per position offline {metrics['offline_acceptance_per_position']}, vLLM "
          f"{metrics['vllm_acceptance_per_position']}, {wall:.0f}s")
    if failure:
        sys.exit(f"evaluate: {failure}")


if __name__ == "__main__":
    main()
