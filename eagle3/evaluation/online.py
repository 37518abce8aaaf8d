"""Acceptance in the engine: vLLM serving target + drafter as exported, counted from its /metrics;
and output tokens/s with and without the drafter."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import httpx

from eagle3.engine import server
from eagle3.engine.client import generation_tokens, scrape
from eagle3.evaluation.acceptance import histogram
from eagle3.evaluation.params import EvalPaths, EvaluateParams
from eagle3.evaluation.questions import conversation, timed_first_turns
from eagle3.params import load_section
from eagle3.progress import Progress


async def chat(client: httpx.AsyncClient, url: str, messages: list[dict], params: EvaluateParams) -> dict[str, Any]:
    response = await client.post(f"{url}/v1/chat/completions", timeout=1800, json={
        "model": "target", "messages": messages, "temperature": params.temperature,
        "max_tokens": params.max_new_tokens, "seed": params.seed})
    response.raise_for_status()
    return response.json()


async def answer_all(url: str, items: list[dict], params: EvaluateParams, concurrency: int,
                     label: str = "evaluate vLLM") -> list[list[str]]:
    """Every question's turns, each later turn conditioned on the engine's own answers."""
    limit = asyncio.Semaphore(concurrency)
    progress = Progress(label, total=sum(len(item["turns"]) for item in items), unit="answers")
    async with httpx.AsyncClient() as client:
        async def one(item: dict) -> list[str]:
            answers: list[str] = []
            for _ in item["turns"]:
                async with limit:
                    body = await chat(client, url, conversation(item["turns"], answers), params)
                answers.append(body["choices"][0]["message"]["content"] or "")
                progress.update(1)
            return answers
        return await asyncio.gather(*(one(item) for item in items))


def output_tokens_per_s(url: str, items: list[dict], params: EvaluateParams, concurrency: int) -> float:
    """Generated tokens per second over the first turns timed at `concurrency` requests at a time."""
    first_turns = timed_first_turns(items, params.throughput_prompts, concurrency)
    before, start = generation_tokens(url), time.monotonic()
    asyncio.run(answer_all(url, first_turns, params, concurrency, f"evaluate throughput x{concurrency}"))
    return (generation_tokens(url) - before) / (time.monotonic() - start)


def serve(params: EvaluateParams, record: dict, speculative: bool, paths: EvalPaths) -> server.ServerState:
    extra = ["--speculative-config", json.dumps({"method": "eagle3", "model": str(paths.drafter.resolve()),
                                                  "num_speculative_tokens": params.num_speculative_tokens})]
    serve_params = dataclasses.replace(load_section("serve", server.ServeParams), port=params.port,
                                       extra_args=extra if speculative else [])
    return server.start(serve_params, record, state_dir=paths.server_state)


def throughput(url: str, items: list[dict], params: EvaluateParams) -> dict[str, float]:
    return {"batch1_tokens_per_s": round(output_tokens_per_s(url, items, params, 1), 2),
            f"concurrency{params.concurrency}_tokens_per_s": round(output_tokens_per_s(url, items, params,
                                                                                      params.concurrency), 2)}


def online_eval(params: EvaluateParams, record: dict, items: list[dict],
                paths: EvalPaths = EvalPaths()) -> dict[str, Any]:
    """The same questions through vLLM serving target + drafter; acceptance read from /metrics."""
    state = serve(params, record, speculative=True, paths=paths)
    try:
        before = scrape(state.url)
        asyncio.run(answer_all(state.url, items, params, params.answer_concurrency))
        after = scrape(state.url)
        with_drafter = throughput(state.url, items, params)
    finally:
        server.stop(paths.server_state)
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    result = {"acceptance_length": 1 + accepted / drafts if drafts else 0.0, "drafts": drafts,
              "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
              "per_position": [(after[f"pos{i}"] - before.get(f"pos{i}", 0)) / drafts if drafts else 0.0
                               for i in range(params.num_speculative_tokens)],
              "histogram": histogram([after[f"pos{i}"] - before.get(f"pos{i}", 0)
                                      for i in range(params.num_speculative_tokens)], drafts),
              "throughput_with_drafter": with_drafter}
    if params.measure_baseline:
        state = serve(params, record, speculative=False, paths=paths)
        try:
            result["throughput_without_drafter"] = throughput(state.url, items, params)
        finally:
            server.stop(paths.server_state)
    return result
