"""Stage `evaluate`: acceptance of the drafter offline (our decoder) and in the real engine (vLLM).

The offline evaluator uses the aux layer ids and vocabulary map the drafter was TRAINED with
(the hidden store's manifest and artifacts/vocab), while vLLM reads what the exported checkpoint
says. The two agree only if the export is right: a checkpoint with shifted aux ids or without its
d2t is served badly by vLLM and the agreement check fails loudly, before anyone deploys it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import numpy as np
import pyarrow.parquet as pq
import torch
from torch import Tensor

from stages import server
from stages.atomic import atomic_write_json
from stages.checkpoint import load_drafter, read_checkpoint
from stages.extract import Capture
from stages.prompts import render
from stages.metrics import write_metrics
from stages.params import load_section
from stages.progress import Progress
from stages.speculative import DecodeStats, SpecDecoder
from stages.target import load_record



@dataclass(frozen=True)
class EvalPaths:
    target: Path = Path("artifacts/target")
    drafter: Path = Path("artifacts/drafter")  # what the engine serves: the export under test
    prompts: Path = Path("artifacts/prompts/eval.parquet")
    vocab: Path = Path("artifacts/vocab")  # the vocabulary map the drafter was trained with
    manifest: Path = Path("artifacts/hidden/manifest.json")  # the aux layer ids it was trained with
    server_state: Path = Path("run/server-eval")
METRIC = re.compile(r'^(vllm:spec_decode_num_(?:drafts|draft_tokens|accepted_tokens|accepted_tokens_per_pos)_total)'
                    r'\{([^}]*)\}\s+([0-9.eE+-]+)$')


@dataclass
class EvaluateParams:
    num_speculative_tokens: int = 3
    temperature: float = 0.0
    max_new_tokens: int = 256
    num_questions: int = 80  # MT-bench questions
    turns: int = 2  # turns per question; turn 2 continues the model's own first answer
    offline: bool = True
    online: bool = True
    concurrency: int = 8  # requests in flight for the throughput figure
    answer_concurrency: int = 40  # requests in flight while vLLM answers the questions (acceptance)
    offline_batch_size: int = 40  # prompts per batched greedy generate (offline, T=0)
    throughput_prompts: int = 8  # prompts timed at batch 1 and at `concurrency`, with and without the drafter
    measure_baseline: bool = True  # also serve the target alone for the throughput comparison
    agreement_tolerance: float = 0.10  # |offline - vLLM| / vLLM acceptance length, at temperature 0
    seed: int = 0
    port: int = 8010


def questions(params: EvaluateParams, prompts: Path) -> list[dict[str, Any]]:
    if params.num_questions < 1 or params.turns < 1 or params.num_speculative_tokens < 1:
        raise ValueError(f"evaluate: num_questions={params.num_questions}, turns={params.turns} and "
                         f"num_speculative_tokens={params.num_speculative_tokens} must all be >= 1")
    items = pq.read_table(prompts).to_pylist()[: params.num_questions]
    if params.online and not 1 <= params.concurrency <= len(items):
        raise ValueError(f"evaluate: concurrency={params.concurrency} requests in flight are timed over as many "
                         f"questions; expected 1..{len(items)} (questions in {prompts}, num_questions="
                         f"{params.num_questions})")
    return [{**item, "turns": item["turns"][: params.turns]} for item in items]


def histogram(accepted_per_pos: list[float], rounds: float) -> list[float]:
    """Share of rounds that accepted exactly n = 0..k drafts. In chain drafting position i is
    accepted only if all before it were, so "at least i+1 accepted" counts are the per-position counts."""
    at_least = [rounds, *accepted_per_pos, 0]
    return [round((at_least[n] - at_least[n + 1]) / rounds, 4) if rounds else 0.0 for n in range(len(at_least) - 1)]


def conversation(turns: list[str], answers: list[str]) -> list[dict[str, str]]:
    """The user's turns with the model's own earlier answers between them."""
    messages = []
    for i, turn in enumerate(turns[: len(answers) + 1]):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


class Answer(NamedTuple):
    tokens: list[int]  # the greedy answer, through its first end-of-turn token
    aux: Tensor | None  # the target's aux states at prompt + answer positions (all but the last), if captured


def greedy_answers(target: Any, prompts: list[list[int]], max_new_tokens: int, eos: set[int], pad_id: int,
                   batch_size: int, progress: Progress, capture: Capture | None = None) -> list[Answer]:
    """The target's greedy answers, `batch_size` prompts per generate call (left-padded), each cut
    after its first end-of-turn token. Batching shares each step's weight reads: decode is bound by them.
    With `capture` (hooks on the target), each answer also keeps the aux states its generation computed,
    so replaying the speculative rounds needs no second target forward over prompt + answer."""
    answers = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        longest = max(map(len, chunk))
        ids = torch.full((len(chunk), longest), pad_id)
        mask = torch.zeros((len(chunk), longest), dtype=torch.long)
        for row, prompt in enumerate(chunk):
            ids[row, longest - len(prompt):] = torch.tensor(prompt)
            mask[row, longest - len(prompt):] = 1
        forwards: list[Tensor] = []  # aux of each forward generate makes: the prompts, then one token per step
        hook = (target.get_decoder().register_forward_hook(lambda *_: forwards.append(capture.take()[0]))
                if capture else None)
        try:
            with torch.no_grad():
                out = target.generate(input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                                      max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(eos),
                                      pad_token_id=pad_id)
        finally:
            if hook:
                hook.remove()
        for row, (prompt, generated) in enumerate(zip(chunk, out[:, longest:].tolist())):
            ends = [i for i, t in enumerate(generated) if t in eos]
            tokens = generated[: ends[0] + 1] if ends else generated
            # answer token i is the input of step i + 1; the last one is never fed back
            aux = (torch.cat([forwards[0][row, longest - len(prompt):],
                              *(step[row] for step in forwards[1 : len(tokens)])]) if capture else None)
            answers.append(Answer(tokens, aux))
        progress.update(len(chunk))
    return answers


def draft_vocab_coverage(answers: list[list[int]], t2d: np.ndarray) -> float:
    """Share of the answers' tokens inside the draft vocabulary. A token outside it is never
    drafted, so this bounds how often a draft can be accepted; the vocab stage's coverage is that of
    the training answers, and a narrower prompt set than the evaluation's shows here first."""
    tokens = np.fromiter((t for answer in answers for t in answer), dtype=np.int64)
    return float(t2d[tokens].mean()) if tokens.size else 0.0


def load_target(record: dict) -> Any:
    """The target through transformers, on the GPUs if there are any (vLLM starts only after the
    offline evaluation), spread over all of them if it needs more than one; else on the CPU."""
    from transformers import AutoModelForCausalLM

    # On CPU, eager attention: SDPA's CPU kernel is slow for one query under the left-padding mask of
    # batched decoding (1.5x the greedy answers' time here). Eager materialises [B, heads, T, T]
    # scores only while prefilling the prompts; GPUs keep SDPA, where long second turns would make that large.
    placement = {"device_map": "auto"} if torch.cuda.is_available() else {"attn_implementation": "eager"}
    return AutoModelForCausalLM.from_pretrained(record["model_path"], dtype=getattr(torch, record["dtype"]),
                                                **placement).eval()


def offline_eval(params: EvaluateParams, record: dict, tokenizer: Any, items: list[dict],
                 paths: EvalPaths = EvalPaths()) -> dict[str, Any]:
    """Chain speculative decoding with our decoder. At T=0 the target's greedy answers are generated
    in batches and the rounds replayed along them (SpecDecoder.replay: the same counts as decoding
    one round at a time, tested); at T>0 every answer is decoded with rejection sampling."""
    target = load_target(record)
    drafter = load_drafter(paths.drafter)
    drafter.d2t = torch.from_numpy(np.load(paths.vocab / "d2t.npy"))  # the map it was trained with
    aux_ids = json.loads(paths.manifest.read_text())["aux_layer_ids"]
    decoder = SpecDecoder(target, drafter, aux_ids, params.num_speculative_tokens, params.temperature,
                          torch.Generator(target.device).manual_seed(params.seed))
    eos = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")} - {None}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    total, per_category = DecodeStats(), defaultdict(DecodeStats)
    answers: list[list[str]] = [[] for _ in items]
    replies: list[list[int]] = []
    for turn in range(max(len(item["turns"]) for item in items)):
        todo = [i for i, item in enumerate(items) if len(item["turns"]) > turn]
        prompts = [render(tokenizer, conversation(items[i]["turns"], answers[i]), True) for i in todo]
        greedy: list[Answer | None] = [None] * len(todo)
        if params.temperature == 0:
            greedy = greedy_answers(target, prompts, params.max_new_tokens, eos, pad_id, params.offline_batch_size,
                                    Progress(f"evaluate offline turn {turn + 1}: greedy answers", len(todo), "answers"),
                                    decoder.capture)
        progress = Progress(f"evaluate offline turn {turn + 1}: speculative rounds", len(todo), "answers")
        for i, prompt, answer in zip(todo, prompts, greedy):
            if answer is None:
                reply, stats = decoder.generate(prompt, params.max_new_tokens, eos)
            else:
                reply = answer.tokens
                stats = decoder.replay(prompt, reply, stop=len(reply), aux=answer.aux)
            answers[i].append(tokenizer.decode(reply, skip_special_tokens=True))
            replies.append(reply)
            total.add(stats)
            per_category[items[i]["category"]].add(stats)
            progress.update(1, extra=f"acceptance length {total.acceptance_length():.3f}")
    return {"acceptance_length": total.acceptance_length(),
            "per_position": [a / total.rounds for a in total.accepted_per_pos],
            "histogram": histogram(total.accepted_per_pos, total.rounds),
            "rounds": total.rounds, "generated": total.generated,
            "draft_vocab_coverage": draft_vocab_coverage(replies, np.load(paths.vocab / "t2d.npy")),
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


def generation_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def timed_first_turns(items: list[dict], prompts: int, concurrency: int) -> list[dict]:
    """The first turns timed at `concurrency`: `prompts` of them, and never fewer than `concurrency`
    (fewer prompts than requests in flight would time a lower concurrency than the figure's name says)."""
    return [{**item, "turns": item["turns"][:1]} for item in items[: max(prompts, concurrency)]]


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


def agreement_failure(offline: dict, online: dict, tolerance: float) -> str | None:
    gap = abs(offline["acceptance_length"] - online["acceptance_length"]) / max(online["acceptance_length"], 1e-9)
    if gap <= tolerance:
        return None
    curves = "\n".join(f"  position {i}: offline {o:.3f}  vLLM {v:.3f}"
                        for i, (o, v) in enumerate(zip(offline["per_position"], online["per_position"])))
    return (f"offline acceptance length {offline['acceptance_length']:.3f} and vLLM's {online['acceptance_length']:.3f} "
            f"differ by {gap:.1%} (> {tolerance:.0%}): the engine does not serve the drafter that was trained "
            f"(aux layer ids, vocab map or weights in the export). Per position:\n{curves}")


def write_plots(k: int, offline: dict | None, online: dict | None) -> None:
    """DVC plots: acceptance per draft position and the accepted-drafts histogram, offline vs vLLM."""
    def column(result: dict | None, key: str, n: int) -> list[float | None]:
        return [round(x, 4) for x in result[key]] if result else [None] * n

    for name, key, n, x in (("evaluate_positions", "per_position", k, "position"),
                            ("evaluate_histogram", "histogram", k + 1, "accepted")):
        rows = zip(column(offline, key, n), column(online, key, n))
        atomic_write_json(Path(f"metrics/{name}.json"), [{x: i, "offline": o, "vllm": v} for i, (o, v) in enumerate(rows)])


def export_mismatches(paths: EvalPaths) -> list[str]:
    """What the engine reads from the export against what the drafter was trained with.

    Acceptance alone misses some defects: on the embedded target, replaying the default drafter
    with aux ids shifted by one gave 1.160 against 1.163 (adjacent layers' states are that alike),
    far inside any tolerance. So the ids and the vocabulary map are compared directly as well.
    """
    config, tensors = read_checkpoint(paths.drafter)
    trained = json.loads(paths.manifest.read_text())["aux_layer_ids"]
    # vLLM prefers a top-level list to eagle_config's (vllm/v1/worker/gpu_model_runner.py).
    served = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    problems = []
    if served != trained:
        problems.append(f"{paths.drafter}/config.json serves aux layer ids {served}; the drafter was trained on "
                        f"{trained} ({paths.manifest})")
    d2t = np.load(paths.vocab / "d2t.npy", allow_pickle=False)
    if "d2t" not in tensors:
        problems.append(f"{paths.drafter}/model.safetensors has no d2t: vLLM would read draft id i as target id i")
    elif not np.array_equal(tensors["d2t"].numpy(), d2t):
        problems.append(f"{paths.drafter}/model.safetensors: d2t differs from the map it was trained with "
                        f"({paths.vocab / 'd2t.npy'})")
    return problems


def main() -> None:
    from transformers import AutoTokenizer

    start = time.monotonic()
    server.require_accelerators_free("evaluate")
    params = load_section("evaluate", EvaluateParams)
    paths = EvalPaths()
    record = load_record(paths.target)
    tokenizer = AutoTokenizer.from_pretrained(paths.target)
    try:
        items = questions(params, paths.prompts)
    except ValueError as err:
        sys.exit(str(err))
    offline = offline_eval(params, record, tokenizer, items) if params.offline else None
    if torch.cuda.is_available():  # the offline target's GPU memory back to the driver before vLLM starts
        gc.collect()
        torch.cuda.empty_cache()
    online = online_eval(params, record, items) if params.online else None
    failure = (agreement_failure(offline, online, params.agreement_tolerance)
               if offline and online and params.temperature == 0 else None)
    mismatches = export_mismatches(paths)
    wall = time.monotonic() - start
    metrics = {"num_draft_tokens": params.num_speculative_tokens, "temperature": params.temperature,
               "questions": len(items), "turns": params.turns,
               "offline_acceptance_length": round(offline["acceptance_length"], 4) if offline else None,
               "offline_acceptance_per_position": [round(x, 4) for x in offline["per_position"]] if offline else None,
               "offline_per_category": offline["per_category"] if offline else None,
               "offline_draft_vocab_coverage": round(offline["draft_vocab_coverage"], 4) if offline else None,
               "vllm_acceptance_length": round(online["acceptance_length"], 4) if online else None,
               "vllm_acceptance_per_position": [round(x, 4) for x in online["per_position"]] if online else None,
               "vllm_drafts": online["drafts"] if online else None,
               "throughput_with_drafter": online["throughput_with_drafter"] if online else None,
               "throughput_without_drafter": (online or {}).get("throughput_without_drafter"),
               "agreement": failure is None, "export_matches_training": not mismatches}
    write_metrics("evaluate", wall, items=len(items), tokens=offline["generated"] if offline else 0, **metrics)
    write_plots(params.num_speculative_tokens, offline, online)
    print(f"evaluate: acceptance length at k={params.num_speculative_tokens}, T={params.temperature}: offline "
          f"{metrics['offline_acceptance_length']}, vLLM {metrics['vllm_acceptance_length']} on {len(items)} "
          f"questions; per position offline {metrics['offline_acceptance_per_position']}, vLLM "
          f"{metrics['vllm_acceptance_per_position']}; the draft vocabulary holds "
          f"{metrics['offline_draft_vocab_coverage']} of the target's answer tokens, {wall:.0f}s")
    if failure or mismatches:
        sys.exit("\n".join(f"evaluate: {problem}" for problem in [*mismatches, *([failure] if failure else [])]))


if __name__ == "__main__":
    main()
