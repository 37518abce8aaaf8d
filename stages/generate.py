"""Stage `generate`: the target answers every training prompt through an OpenAI-compatible server.

Token-exact: the prompt is rendered once with the target's chat template and the server's own
prompt and completion token ids are stored, so the drafter learns exactly the stream the target
emitted (wrapper and thinking tokens included). Results go to parquet parts in run/generate/,
each written atomically; a rerun skips the prompts already stored, so a crash loses at most the
last unwritten part and never duplicates a response. The DVC output is assembled at the end.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq

from stages import server
from stages.atomic import atomic_dir, atomic_write_bytes, atomic_write_json, parquet_bytes
from stages.metrics import write_metrics
from stages.params import load_section
from stages.progress import Progress, format_duration
from stages.prompts import render
from stages.target import load_record

WORK_DIR = Path("run/generate")
OUT = Path("artifacts/responses")
PROMPTS = Path("artifacts/prompts/train.parquet")
TARGET_DIR = Path("artifacts/target")
REGENERATE_MODES = ("last", "all")


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
class GenerateParams:
    server_url: str | None = None  # an external server to use as is; None = start/stop ours (`serve` params)
    health_timeout_s: float = 60  # how long an external server may take to answer /health
    concurrency: int = 32
    request_timeout_s: float = 600
    max_retries: int = 8
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int = 0  # request i gets seed + its position, so sampled runs are reproducible per prompt
    part_size: int = 32
    max_error_ratio: float = 0.01
    regenerate: str = "last"  # last: answer the last user turn; all: every turn, with the model's own answers


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


def template_matches(tokenizer: Any, context: list[dict], content: str, reasoning: str | None, ids: list[int]) -> bool:
    """Re-rendering reasoning + content must reproduce the stored ids (the stored ids stay the truth)."""
    answer = {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})}
    rendered = render(tokenizer, context + [answer], generation_prompt=False)
    return rendered[: len(ids)] == ids


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


RESPONSE_SCHEMA = pa.schema([
    ("id", pa.string()), ("prompt_id", pa.string()), ("turn", pa.int32()),
    ("prompt_token_ids", pa.list_(pa.int32())), ("completion_token_ids", pa.list_(pa.int32())),
    ("finish_reason", pa.string()), ("content", pa.string()), ("reasoning", pa.string()),
    ("template_match", pa.bool_()), ("usage", pa.string()), ("sampling", pa.string()), ("messages", pa.string()),
])


class PartWriter:
    """Whole prompts buffered, then written as one atomic parquet part: a crash loses only the buffer."""

    def __init__(self, parts_dir: Path, part_size: int):
        self.parts_dir, self.part_size = parts_dir, part_size
        parts_dir.mkdir(parents=True, exist_ok=True)
        self.next_index = 1 + max((int(p.stem.split("-")[1]) for p in parts_dir.glob("part-*.parquet")), default=-1)
        self.rows: list[dict[str, Any]] = []
        self.prompts = 0

    def add(self, rows: list[dict[str, Any]]) -> None:
        self.rows += rows
        self.prompts += 1
        if self.prompts >= self.part_size:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        atomic_write_bytes(self.parts_dir / f"part-{self.next_index:06d}.parquet",
                           parquet_bytes(pa.Table.from_pylist(self.rows, schema=RESPONSE_SCHEMA)))
        self.next_index += 1
        self.rows, self.prompts = [], 0


def read_parts(parts_dir: Path) -> pa.Table:
    parts = sorted(parts_dir.glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(p) for p in parts]) if parts else RESPONSE_SCHEMA.empty_table()


def run_fingerprint(record: dict[str, Any], tokenizer: Any, params: GenerateParams) -> str:
    """Stored responses are reusable only for the same weights, template and sampling."""
    import hashlib

    key = {"weights": record["weights_hash"], "template": tokenizer.chat_template,
           **{k: getattr(params, k) for k in ("temperature", "top_p", "max_tokens", "seed", "regenerate")}}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def write_progress(path: Path, progress: Progress, counters: Counters, started_at: float) -> None:
    atomic_write_json(path, {"pid": os.getpid(), "total": progress.total, "done": progress.done,
                             "errors": counters.errors, "retries": counters.retries,
                             "skipped": sum(counters.skipped.values()), "generated_tokens": counters.generated_tokens,
                             "rate_per_s": round(progress.rate(), 4), "eta_s": progress.eta_s(),
                             "started_at": started_at, "updated_at": time.time()})


def progress_lines(root: Path = WORK_DIR) -> list[str]:
    """For `make status`: the newest generation's progress, running or interrupted."""
    files = sorted(root.glob("*/progress.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        return ["generate: no generation has run yet"]
    p = json.loads(files[-1].read_text())
    finished = p["done"] >= p["total"]
    state = "running" if server.pid_alive(p["pid"]) and not finished else ("finished" if finished else "interrupted")
    eta = f", ETA {format_duration(p['eta_s'])}" if state == "running" and p["eta_s"] is not None else ""
    return [f"generate: {state}: {p['done']}/{p['total']} prompts, {p['rate_per_s']:.2f} prompts/s, "
            f"{p['generated_tokens']} tokens this run, {p['errors']} errors, {p['retries']} retries, "
            f"{p['skipped']} skipped{eta} ({files[-1].parent})"]


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


class GenerateError(RuntimeError):
    pass


def same_model(served: str, expected: str) -> bool:
    if Path(served).exists() and Path(expected).exists():
        return Path(served).resolve() == Path(expected).resolve()
    return served == expected


def check_served_model(url: str, entry: dict[str, Any], record: dict[str, Any], tokenizer: Any) -> None:
    """Refuse a server whose weights or chat template differ from artifacts/target."""
    served = entry.get("root") or entry["id"]
    if not same_model(served, record["model_path"]):
        raise GenerateError(f"server at {url} serves {served!r}, but artifacts/target is {record['model_path']!r}")
    probe = [{"role": "user", "content": "Tokenizer check: 1 + 1 = 2, naïve café."}]
    response = httpx.post(f"{url}/tokenize", json={"model": entry["id"], "messages": probe,
                                                   "add_generation_prompt": True}, timeout=30)
    if response.status_code == 404:
        print(f"generate: {url} has no /tokenize; relying on the per-request prompt id check", file=sys.stderr)
    elif response.json().get("tokens") != render(tokenizer, probe, generation_prompt=True):
        raise GenerateError(f"server at {url} renders prompts with another tokenizer or chat template than "
                            f"artifacts/target ({record['model_path']})")


def connect(params: GenerateParams, serve: server.ServeParams, record: dict[str, Any]) -> tuple[str, dict, bool]:
    """(url, served model entry, whether we started the server and must stop it)."""
    if params.server_url:
        url = params.server_url.rstrip("/")
        try:
            return url, server.wait_healthy(url, params.health_timeout_s), False
        except server.ServerError as err:
            raise GenerateError(f"generate.server_url={params.server_url}: {err}") from None
    running = server.running_server()
    state = running or server.start(serve, record)
    return state.url, server.wait_healthy(state.url, serve.startup_timeout_s), running is None


def assemble(work: Path, prompts: list[dict[str, Any]], out: Path) -> pa.Table:
    """The DVC output: this prompt set's responses in prompt order, whatever order they finished in."""
    import pyarrow.compute as pc

    table = read_parts(work / "parts")
    order = pc.index_in(table["prompt_id"], value_set=pa.array([p["id"] for p in prompts]))
    table = table.append_column("order", order).filter(pc.is_valid(order))
    table = table.sort_by([("order", "ascending"), ("turn", "ascending")]).drop_columns(["order"])
    with atomic_dir(out) as tmp:
        pq.write_table(table, tmp / "responses.parquet")
        (tmp / "errors.jsonl").write_bytes((work / "errors.jsonl").read_bytes())
    return table


def response_stats(table: pa.Table) -> dict[str, Any]:
    lengths = [len(ids) for ids in table["completion_token_ids"].to_pylist()]
    return {"responses": table.num_rows, "generated_tokens": sum(lengths),
            "prompt_tokens": sum(len(ids) for ids in table["prompt_token_ids"].to_pylist()),
            "mean_completion_tokens": round(sum(lengths) / len(lengths), 1) if lengths else 0,
            "max_completion_tokens": max(lengths, default=0),
            "finish_reasons": dict(Counter(table["finish_reason"].to_pylist())),
            "template_mismatches": table.num_rows - sum(table["template_match"].to_pylist())}


def check_params(params: GenerateParams) -> None:
    if params.regenerate not in REGENERATE_MODES:
        raise GenerateError(f"generate.regenerate={params.regenerate!r}: expected one of {', '.join(REGENERATE_MODES)}")
    for name in ("concurrency", "max_tokens", "part_size"):
        if getattr(params, name) <= 0:
            raise GenerateError(f"generate.{name}={getattr(params, name)}: expected a positive number")


async def run(params: GenerateParams, url: str, entry: dict[str, Any], tokenizer: Any,
              todo: list[tuple[int, dict]], work: Path, total: int, done: int) -> Counters:
    counters = Counters()
    limits = httpx.Limits(max_connections=params.concurrency, max_keepalive_connections=params.concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        ctx = Context(params, url, entry["id"], int(entry.get("max_model_len") or 1 << 30), tokenizer, client,
                      counters, asyncio.Semaphore(params.concurrency))
        progress = Progress("generate", total, unit="prompts", done=done)
        await generate_all(ctx, todo, PartWriter(work / "parts", params.part_size), work, progress)
    return counters


def main() -> None:
    from transformers import AutoTokenizer

    start = time.monotonic()
    params = load_section("generate", GenerateParams)
    serve = load_section("serve", server.ServeParams)
    record = load_record(TARGET_DIR)
    tokenizer = AutoTokenizer.from_pretrained(TARGET_DIR)
    prompts = pq.read_table(PROMPTS).to_pylist()
    work = WORK_DIR / run_fingerprint(record, tokenizer, params)
    work.mkdir(parents=True, exist_ok=True)
    stored = set(read_parts(work / "parts")["prompt_id"].to_pylist())
    todo = [(i, p) for i, p in enumerate(prompts) if p["id"] not in stored]
    print(f"generate: {len(prompts)} prompts, {len(prompts) - len(todo)} already answered in {work}, "
          f"{len(todo)} to go", file=sys.stderr)
    started, counters = False, Counters()
    try:
        check_params(params)
        if todo:  # all answered already (a resumed run): no server needed
            url, entry, started = connect(params, serve, record)
            check_served_model(url, entry, record, tokenizer)
            counters = asyncio.run(run(params, url, entry, tokenizer, todo, work, len(prompts),
                                       len(prompts) - len(todo)))
    except (GenerateError, server.ServerError) as err:
        sys.exit(f"generate: {err}")
    finally:
        if started:
            server.stop()
    failed_ratio = counters.errors / max(len(prompts), 1)
    if failed_ratio > params.max_error_ratio:
        sys.exit(f"generate: {counters.errors} of {len(prompts)} prompts failed ({failed_ratio:.1%} > "
                 f"generate.max_error_ratio={params.max_error_ratio}); reasons in {work / 'errors.jsonl'}. "
                 f"Finished responses are kept: `dvc repro generate` retries just the failed ones.")
    table = assemble(work, prompts, OUT)
    stats = response_stats(table)
    wall = time.monotonic() - start
    this_run = {"requests": counters.requests, "retries": counters.retries, "errors": counters.errors,
                "skipped": dict(counters.skipped), "new_generated_tokens": counters.generated_tokens,
                "generated_tokens_per_s": round(counters.generated_tokens / wall, 1),
                "requests_per_s": round((counters.requests - counters.retries) / wall, 3)}
    atomic_write_json(OUT / "stats.json", {**stats, **this_run, "sampling": asdict(params)})
    write_metrics("generate", wall, items=stats["responses"], tokens=stats["generated_tokens"], **stats, **this_run)
    print(f"generate: {stats['responses']} responses ({len(todo) - counters.errors - sum(counters.skipped.values())} "
          f"new), {stats['generated_tokens']} tokens generated (mean {stats['mean_completion_tokens']}, max "
          f"{stats['max_completion_tokens']}), {this_run['requests_per_s']} req/s, "
          f"{this_run['generated_tokens_per_s']} gen tok/s, {counters.errors} errors, {counters.retries} retries, "
          f"skipped {dict(counters.skipped)}, finish {stats['finish_reasons']}, template mismatches "
          f"{stats['template_mismatches']}, {wall:.0f}s -> {OUT}")


if __name__ == "__main__":
    main()
