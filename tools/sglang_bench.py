"""SGLang benchmark: serve the target with the SGLang export of the drafter, measure acceptance and tok/s.

    python -m tools.sglang_bench [--python PYTHON_WITH_SGLANG] [--drafter artifacts/drafter]
                                  [--port 8020] [--dtype bfloat16] [--no-baseline]

Needs an NVIDIA GPU and sglang (EAGLE-3 in SGLang runs on CUDA); anywhere else it exits 2 saying what
is missing. sglang pins its own torch, so it usually lives in its own virtual environment: --python
names that interpreter, this process only sends requests. Steps: export the drafter (eagle3/model/sglang.py,
validated), `python -m sglang.launch_server` on 127.0.0.1 with a chain of k drafted tokens
(--speculative-eagle-topk 1, --speculative-num-draft-tokens k+1, what vLLM's num_speculative_tokens=k
drafts), the evaluation's questions (evaluate.sets, drawn as the evaluate stage draws them) at each of
evaluate.temperatures with the other settings of params.yaml `evaluate` (so both engines' numbers
compare), then the target alone for the throughput baseline. Writes metrics/sglang_bench.json.

Acceptance comes from each response's meta_info on /generate (sglang 0.5.23,
managers/tokenizer_manager.py _calculate_spec_decoding_metrics; spec_verify_ct is counted once per
verify in managers/scheduler_components/batch_result_processor.py): completion_tokens, spec_verify_ct
and, in recent releases, spec_correct_drafts_histogram. Per request, not the server-wide running
averages (`avg_spec_accept_length` of /server_info, the "accept len" log line, the sglang:spec_accept_length
gauge), so exactly these prompts are measured.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from eagle3.engine import server
from eagle3.engine.state import ServerError, ServerState
from eagle3.evaluation.params import EvaluateError, EvaluateParams
from eagle3.evaluation.questions import conversation, questions, timed_first_turns
from eagle3.metrics import gpus, write_metrics
from eagle3.model.sglang import DRAFTER_DIR, OUT_DIR, TARGET_DIR, ExportError, export
from eagle3.params import ParamsError, load_section
from eagle3.target.chat import render
from eagle3.target.record import load_record, load_tokenizer

EVAL_PROMPTS = Path("artifacts/prompts/eval.parquet")
STATE_DIR = Path("run/server-sglang")


class BenchError(RuntimeError):
    pass


@dataclass
class BenchParams:
    """The vLLM evaluation's settings (params.yaml `evaluate`: questions, k, temperatures, turns,
    concurrency) plus SGLang's own."""
    evaluate: EvaluateParams
    port: int = 8020
    # SGLang's CUDA attention back ends are built for 16-bit inputs: a float32 target is served in
    # bf16 here, so its acceptance can differ a little from a float32 vLLM run.
    dtype: str = "bfloat16"
    measure_baseline: bool = True


def missing_requirements(sglang_importable: bool, gpu_names: list[str], python: str) -> list[str]:
    missing = []
    if not gpu_names:
        missing.append("no NVIDIA GPU (nvidia-smi lists none): SGLang's EAGLE-3 speculative decoding runs on CUDA")
    if not sglang_importable:
        missing.append(f"sglang is not importable by {python} (it pins its own torch: install it in a separate "
                       "virtual environment, e.g. `pip install sglang`, and name that python: make sglang-bench "
                       "SGLANG_PY=<env>/bin/python, or --python)")
    return missing


def importable(python: str, module: str) -> bool:
    # Asked of the interpreter that will run the server, which may not be this one.
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def sglang_command(python: str, serve: server.ServeParams, record: dict[str, Any], params: BenchParams,
                   drafter: Path | None) -> list[str]:
    cmd = [python, "-m", "sglang.launch_server", "--model-path", record["model_path"],
           "--served-model-name", serve.served_model_name, "--host", serve.host, "--port", str(params.port),
           "--dtype", params.dtype, "--context-length", str(serve.max_model_len),
           "--tp-size", str(serve.tensor_parallel_size)]
    if record.get("revision"):
        cmd += ["--revision", record["revision"]]
    if record.get("trust_remote_code"):
        cmd.append("--trust-remote-code")
    if drafter is None:
        return cmd
    k = params.evaluate.num_speculative_tokens
    return cmd + ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafter.resolve()),
                  "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                  "--speculative-num-draft-tokens", str(k + 1)]


def acceptance(metas: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """Acceptance of these requests (meta_info) at k drafts a round, in vLLM's terms: tokens per target forward."""
    verifies = sum(m.get("spec_verify_ct", 0) for m in metas)
    if not verifies:
        raise BenchError("SGLang reported no verify steps (meta_info.spec_verify_ct): the drafter did not run")
    tokens = sum(m["completion_tokens"] for m in metas)
    result: dict[str, Any] = {
        # A request's first token comes from the prefill, without a verify; each verify then yields
        # 1 + accepted tokens: (tokens - requests) / verifies is vLLM's 1 + accepted / drafts.
        "acceptance_length": (tokens - len(metas)) / verifies,
        "sglang_accept_length": tokens / verifies,  # SGLang's own figure: completion_tokens / spec_verify_ct
        "verify_steps": verifies, "generated_tokens": tokens, "requests": len(metas),
        "per_position": None, "histogram": None}
    histograms = [m.get("spec_correct_drafts_histogram") or [] for m in metas]
    if sum(map(sum, histograms)) == verifies:  # releases that report it: [steps that accepted n drafts]
        counts = [sum(h[n] for h in histograms if n < len(h)) for n in range(k + 1)]
        # A chain accepts draft position i only if it accepts every earlier one: i+1 or more drafts.
        result["per_position"] = [sum(counts[i + 1:]) / verifies for i in range(k)]
        result["histogram"] = [c / verifies for c in counts]
    return result


async def generate(client: httpx.AsyncClient, url: str, input_ids: list[int], temperature: float,
                   max_new_tokens: int) -> dict[str, Any]:
    response = await client.post(f"{url}/generate", timeout=1800, json={
        "input_ids": input_ids, "sampling_params": {"temperature": temperature, "max_new_tokens": max_new_tokens}})
    response.raise_for_status()
    return response.json()


async def answer_all(url: str, tokenizer: Any, items: list[dict], evaluate: EvaluateParams, temperature: float,
                     concurrency: int) -> list[dict[str, Any]]:
    """Every question's turns (later turns continue the engine's own answers); each response's meta_info."""
    limit, metas = asyncio.Semaphore(concurrency), []
    async with httpx.AsyncClient() as client:
        async def one(item: dict) -> None:
            answers: list[str] = []
            for _ in item["turns"]:
                ids = render(tokenizer, conversation(item["turns"], answers), True)
                async with limit:
                    body = await generate(client, url, ids, temperature, evaluate.max_new_tokens)
                answers.append(body["text"])
                metas.append({**body["meta_info"], "set": item["set"]})
        await asyncio.gather(*(one(item) for item in items))
    return metas


def tokens_per_s(url: str, tokenizer: Any, items: list[dict], evaluate: EvaluateParams, concurrency: int) -> float:
    # Timed at the first temperature, as the vLLM evaluation times its throughput.
    first_turns = timed_first_turns(items, evaluate.throughput_prompts, concurrency)
    start = time.monotonic()
    metas = asyncio.run(answer_all(url, tokenizer, first_turns, evaluate, evaluate.temperatures[0], concurrency))
    return round(sum(m["completion_tokens"] for m in metas) / (time.monotonic() - start), 2)


def throughput(url: str, tokenizer: Any, items: list[dict], evaluate: EvaluateParams) -> dict[str, float]:
    return {"batch1_tokens_per_s": tokens_per_s(url, tokenizer, items, evaluate, 1),
            f"concurrency{evaluate.concurrency}_tokens_per_s": tokens_per_s(url, tokenizer, items, evaluate,
                                                                             evaluate.concurrency)}


def serve(command: list[str], serve_params: server.ServeParams, record: dict[str, Any],
          port: int) -> ServerState:
    # SGLang's first start compiles kernels and captures CUDA graphs: give it twice vLLM's start-up time.
    params = dataclasses.replace(serve_params, port=port, startup_timeout_s=2 * serve_params.startup_timeout_s)
    return server.start(params, record, state_dir=STATE_DIR, command=command)


def by_temperature(metas_at: dict[float, list[dict[str, Any]]], k: int) -> dict[str, Any]:
    """Acceptance at each temperature, per set, and its headline: the mean over sets, as the vLLM
    evaluation's (each set counts once)."""
    result = {}
    for temperature, metas in metas_at.items():
        sets = {name: acceptance([m for m in metas if m["set"] == name], k)
                for name in dict.fromkeys(m["set"] for m in metas)}
        result[f"T={temperature}"] = {
            "acceptance_length": round(sum(s["acceptance_length"] for s in sets.values()) / len(sets), 4),
            "pooled": acceptance(metas, k), "sets": sets}
    return result


def run(python: str, drafter: Path, params: BenchParams) -> dict[str, Any]:

    exported = export(drafter, OUT_DIR, TARGET_DIR)
    record, serve_params = load_record(TARGET_DIR), load_section("serve", server.ServeParams)
    tokenizer = load_tokenizer(TARGET_DIR)
    evaluate = params.evaluate
    items = questions(evaluate, EVAL_PROMPTS)
    state = serve(sglang_command(python, serve_params, record, params, OUT_DIR), serve_params, record, params.port)
    try:
        metas_at = {t: asyncio.run(answer_all(state.url, tokenizer, items, evaluate, t, evaluate.answer_concurrency))
                    for t in evaluate.temperatures}
        result: dict[str, Any] = {"acceptance": by_temperature(metas_at, evaluate.num_speculative_tokens)}
        result["throughput_with_drafter"] = throughput(state.url, tokenizer, items, evaluate)
    finally:
        server.stop(STATE_DIR)
    if params.measure_baseline:
        state = serve(sglang_command(python, serve_params, record, params, None), serve_params, record, params.port)
        try:
            result["throughput_without_drafter"] = throughput(state.url, tokenizer, items, evaluate)
        finally:
            server.stop(STATE_DIR)
    result["requests"] = sum(len(metas) for metas in metas_at.values())
    result["generated_tokens"] = sum(m["completion_tokens"] for metas in metas_at.values() for m in metas)
    result["sglang_aux_layer_ids"] = exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    result["questions"] = len(items)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=sys.executable, help="interpreter whose environment has sglang")
    parser.add_argument("--drafter", type=Path, default=DRAFTER_DIR, help="the drafter as trained (vLLM format)")
    parser.add_argument("--port", type=int, default=BenchParams.port)
    parser.add_argument("--dtype", default=BenchParams.dtype)
    parser.add_argument("--no-baseline", action="store_true", help="skip serving the target alone")
    args = parser.parse_args(argv)
    missing = missing_requirements(importable(args.python, "sglang"), gpus(), args.python)
    if missing:
        print("sglang-bench: cannot run on this machine:\n" + "\n".join(f"  - {m}" for m in missing), file=sys.stderr)
        return 2
    try:
        evaluate = load_section("evaluate", EvaluateParams)
    except ParamsError as err:
        print(f"sglang-bench: {err}", file=sys.stderr)
        return 1
    params = BenchParams(evaluate, port=args.port, dtype=args.dtype,
                         measure_baseline=evaluate.measure_baseline and not args.no_baseline)
    start = time.monotonic()
    try:
        result = run(args.python, args.drafter, params)
    except (BenchError, EvaluateError, ExportError, ServerError) as err:
        print(f"sglang-bench: {err}", file=sys.stderr)
        return 1
    write_metrics("sglang_bench", time.monotonic() - start, items=result["requests"],
                  tokens=result["generated_tokens"], num_draft_tokens=evaluate.num_speculative_tokens, **result)
    lengths = ", ".join(f"{t} {a['acceptance_length']:.3f}" for t, a in result["acceptance"].items())
    print(f"sglang-bench: acceptance length (mean over sets) {lengths} at k={evaluate.num_speculative_tokens} on "
          f"{result['questions']} questions ({result['requests']} answers); tok/s with drafter "
          f"{result['throughput_with_drafter']}, without {result.get('throughput_without_drafter')}; "
          "metrics/sglang_bench.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
