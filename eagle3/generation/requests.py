"""Answering prompts through an OpenAI-compatible server, token-exact, with bounded concurrency.

Each prompt is rendered once with the target's chat template; the request asks for the server's
token ids (`return_token_ids`), and the server's prompt ids must equal our rendering, else the
row is an error and is never stored. Connection errors, timeouts, 429, 5xx and unreadable bodies
are retried with exponential backoff and jitter; other 4xx are permanent and recorded.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from eagle3.engine import server
from eagle3.engine.state import ServerError, running_server
from eagle3.errors import PipelineError
from eagle3.generation.parts import PartWriter
from eagle3.generation.status import write_progress
from eagle3.metrics import gpus
from eagle3.progress import Progress
from eagle3.target.chat import render, template_matches
from eagle3.target.compute import served_dtype

REGENERATE_MODES = ("last", "all")


@dataclass
class GenerateParams:
    server_url: str | None  # an external server to use as is; None = start/stop ours (`serve` params)
    health_timeout_s: float  # how long an external server may take to answer /health
    concurrency: int
    request_timeout_s: float
    max_retries: int
    backoff_base_s: float
    backoff_max_s: float
    temperature: float
    top_p: float
    max_tokens: int
    seed: int  # request i gets seed + its position, so sampled runs are reproducible per prompt
    part_size: int
    max_error_ratio: float
    regenerate: str  # last: answer the last user turn; all: every turn, with the model's own answers
    # One request at a time, to a server without prefix caching: the same token ids run after run (vLLM's
    # batched numerics depend on which requests share a batch, and a cached prefix takes another kernel path).
    deterministic: bool


class GenerateError(PipelineError, RuntimeError):
    pass


def run_fingerprint(record: dict[str, Any], tokenizer: Any, params: GenerateParams) -> str:
    """Stored responses are reusable only for the same weights, template, sampling and served dtype (a
    float32 server on a CPU without bf16 answers otherwise than a bf16 one). The dtype of a server given by
    generate.server_url is not known here; it joins the key only where our server serves another dtype than
    the record's, so the usual key stays as it was."""
    key = {"weights": record["weights_hash"], "template": tokenizer.chat_template,
           **{k: getattr(params, k) for k in ("temperature", "top_p", "max_tokens", "seed", "regenerate", "deterministic")}}
    if not params.server_url and (serves := served_dtype(record, bool(gpus()))) != record["dtype"]:
        key["served_dtype"] = serves
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def check_params(params: GenerateParams) -> None:
    if params.regenerate not in REGENERATE_MODES:
        raise GenerateError(f"generate.regenerate={params.regenerate!r}: expected one of {', '.join(REGENERATE_MODES)}")
    for name in ("concurrency", "max_tokens", "part_size"):
        if getattr(params, name) <= 0:
            raise GenerateError(f"generate.{name}={getattr(params, name)}: expected a positive number")


class Permanent(Exception):
    """A request that must not be retried: recorded in errors.jsonl with its status and reason."""

    def __init__(self, status: int | None, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


class Transient(Exception):
    pass


class Skip(Exception):
    """A prompt that is not sent (empty, or too long for the server's context)."""


@dataclass
class Counters:
    requests: int = 0
    retries: int = 0
    errors: int = 0
    generated_tokens: int = 0
    template_mismatches: int = 0
    skipped: Counter = field(default_factory=Counter)
    finish_reasons: Counter = field(default_factory=Counter)


@dataclass
class Context:
    """What every request needs; built once per run."""
    params: GenerateParams
    url: str
    model: str
    max_model_len: int
    tokenizer: Any
    client: httpx.AsyncClient
    counters: Counters
    semaphore: asyncio.Semaphore


def backoff_s(attempt: int, params: GenerateParams) -> float:
    # Exponential with jitter, so many clients that failed together do not retry together.
    return min(params.backoff_max_s, params.backoff_base_s * 2 ** attempt) * random.uniform(0.5, 1.0)


async def post_with_retries(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    """Connection errors, timeouts, 429, 5xx and unreadable bodies are retried; other 4xx are permanent."""
    last = ""
    for attempt in range(ctx.params.max_retries + 1):
        if attempt:
            ctx.counters.retries += 1
            await asyncio.sleep(backoff_s(attempt - 1, ctx.params))
        try:
            ctx.counters.requests += 1
            response = await ctx.client.post(f"{ctx.url}/v1/chat/completions", json=payload,
                                             timeout=ctx.params.request_timeout_s)
            if response.status_code == 429 or response.status_code >= 500:
                raise Transient(f"HTTP {response.status_code}")
            if response.status_code >= 400:
                raise Permanent(response.status_code, response.text[:500])
            return response.json()
        except (httpx.TransportError, Transient, ValueError) as err:
            last = f"{type(err).__name__}: {err}"
    raise Permanent(None, f"gave up after {ctx.params.max_retries} retries ({last})")


def message_text(body: dict[str, Any]) -> tuple[str, str | None]:
    message = body["choices"][0]["message"]
    return message.get("content") or "", message.get("reasoning") or message.get("reasoning_content")


async def answer_turn(ctx: Context, context: list[dict], request_seed: int) -> dict[str, Any]:
    prompt_ids = render(ctx.tokenizer, context, generation_prompt=True)
    if not context[-1]["content"].strip():
        raise Skip("empty")
    if len(prompt_ids) + ctx.params.max_tokens > ctx.max_model_len:
        raise Skip("too_long")
    sampling = {"temperature": ctx.params.temperature, "top_p": ctx.params.top_p,
                "max_tokens": ctx.params.max_tokens, "seed": request_seed}
    body = await post_with_retries(ctx, {"model": ctx.model, "messages": context, "return_token_ids": True,
                                         "skip_special_tokens": False, **sampling})
    choice = body["choices"][0]
    if choice.get("token_ids") is None or body.get("prompt_token_ids") is None:
        raise Permanent(200, "server returned no token ids: it must answer `return_token_ids` (vLLM >= 0.10)")
    if body["prompt_token_ids"] != prompt_ids:
        first = next((i for i, (a, b) in enumerate(zip(body["prompt_token_ids"], prompt_ids)) if a != b),
                     min(len(prompt_ids), len(body["prompt_token_ids"])))
        raise Permanent(200, f"server's prompt ids differ from our chat-template rendering at position {first}")
    content, reasoning = message_text(body)
    ids = prompt_ids + list(choice["token_ids"])
    matches = template_matches(ctx.tokenizer, context, content, reasoning, ids)
    ctx.counters.template_mismatches += not matches
    ctx.counters.generated_tokens += len(choice["token_ids"])
    ctx.counters.finish_reasons[choice["finish_reason"]] += 1
    return {"prompt_token_ids": prompt_ids, "completion_token_ids": list(choice["token_ids"]),
            "finish_reason": choice["finish_reason"], "content": content, "reasoning": reasoning,
            "template_match": matches, "usage": json.dumps(body.get("usage")), "sampling": json.dumps(sampling),
            "messages": json.dumps(context, ensure_ascii=False)}


async def answer_prompt(ctx: Context, prompt: dict[str, Any], index: int) -> list[dict[str, Any]]:
    """One row per answered turn; in "all" mode later turns see the model's own earlier answers."""
    messages = json.loads(prompt["messages"])
    seed = ctx.params.seed + index
    if ctx.params.regenerate == "last":
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        turns = [await answer_turn(ctx, messages[: last_user + 1], seed)]
    else:
        turns, conversation = [], []
        for message in messages:
            if message["role"] == "assistant":
                continue  # replaced by the model's own answer
            conversation.append(message)
            if message["role"] == "user":
                turns.append(await answer_turn(ctx, list(conversation), seed))
                conversation.append({"role": "assistant", "content": turns[-1]["content"]})
    return [{"id": f"{prompt['id']}:{turn}", "prompt_id": prompt["id"], "turn": turn, **row}
            for turn, row in enumerate(turns)]


async def generate_all(ctx: Context, todo: list[tuple[int, dict]], writer: PartWriter, work: Path,
                       progress: Progress) -> None:
    started_at = time.time()
    with open(work / "errors.jsonl", "w", encoding="utf-8") as errors:
        async def one(index: int, prompt: dict[str, Any]) -> None:
            async with ctx.semaphore:
                try:
                    rows = await answer_prompt(ctx, prompt, index)
                    writer.add(rows)
                except Skip as skip:
                    ctx.counters.skipped[str(skip)] += 1
                except Permanent as err:
                    ctx.counters.errors += 1
                    errors.write(json.dumps({"id": prompt["id"], "status": err.status, "reason": err.reason}) + "\n")
                    errors.flush()
            progress.update(1, extra=f"{ctx.counters.generated_tokens / max(time.monotonic() - progress.start, 1e-9):.1f} "
                                     f"gen tok/s, {ctx.counters.errors} errors, {ctx.counters.retries} retries")
            write_progress(work / "progress.json", progress, ctx.counters, started_at)

        await asyncio.gather(*(one(i, p) for i, p in todo))
    writer.flush()
    write_progress(work / "progress.json", progress, ctx.counters, started_at)


def connect(params: GenerateParams, serve: server.ServeParams, record: dict[str, Any]) -> tuple[str, dict, bool]:
    """(url, served model entry, whether we started the server and must stop it)."""
    if params.server_url:
        url = params.server_url.rstrip("/")
        try:
            return url, server.wait_healthy(url, params.health_timeout_s), False
        except ServerError as err:
            raise GenerateError(f"generate.server_url={params.server_url}: {err}") from None
    running = running_server()
    if params.deterministic:
        if running:
            print(f"generate: deterministic, but reusing the running server {running.url}: the ids repeat only "
                  "if it was started without prefix caching", file=sys.stderr)
        serve = dataclasses.replace(serve, extra_args=[*serve.extra_args, "--no-enable-prefix-caching"])
    state = running or server.start(serve, record)
    return state.url, server.wait_healthy(state.url, serve.startup_timeout_s), running is None


async def run(params: GenerateParams, url: str, entry: dict[str, Any], tokenizer: Any,
              todo: list[tuple[int, dict]], work: Path, total: int, done: int) -> Counters:
    counters = Counters()
    concurrency = 1 if params.deterministic else params.concurrency
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        ctx = Context(params, url, entry["id"], int(entry.get("max_model_len") or 1 << 30), tokenizer, client,
                      counters, asyncio.Semaphore(concurrency))
        progress = Progress("generate", total, unit="prompts", done=done)
        await generate_all(ctx, todo, PartWriter(work / "parts", params.part_size), work, progress)
    return counters
