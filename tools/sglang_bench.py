"""SGLang benchmark: serve the target with the SGLang export of the drafter, measure acceptance and tok/s.

    python -m tools.sglang_bench [--python PYTHON_WITH_SGLANG] [--drafter artifacts/drafter]
                                  [--port 8020] [--dtype bfloat16] [--no-baseline]

Needs an NVIDIA GPU and sglang (EAGLE-3 in SGLang runs on CUDA); anywhere else it exits 2 saying what
is missing. sglang pins its own torch, so it usually lives in its own virtual environment: --python
names that interpreter, this process only sends requests. Steps: export the drafter (eagle3/model/sglang.py,
validated), `python -m sglang.launch_server` on 127.0.0.1 with a chain of k drafted tokens
(--speculative-eagle-topk 1, --speculative-num-draft-tokens k+1, what vLLM's num_speculative_tokens=k
drafts), the MT-bench eval prompts with the settings of params.yaml `evaluate` (so both engines' numbers
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
import pyarrow.parquet as pq

from eagle3.engine import server
from eagle3.engine.state import ServerError, ServerState
from eagle3.evaluation.questions import conversation, timed_first_turns
from eagle3.metrics import gpus, write_metrics
from eagle3.model.sglang import DRAFTER_DIR, OUT_DIR, TARGET_DIR, ExportError, export
from eagle3.params import load_section, read_params
from eagle3.target.chat import render
from eagle3.target.record import load_record

EVAL_PROMPTS = Path("artifacts/prompts/eval.parquet")
STATE_DIR = Path("run/server-sglang")


class BenchError(RuntimeError):
    pass


@dataclass
class BenchParams:
    """The knobs shared with the vLLM evaluation (read from params.yaml `evaluate`) plus SGLang's own."""
    num_speculative_tokens: int
    temperature: float
    max_new_tokens: int
    num_questions: int
    turns: int
    concurrency: int
    throughput_prompts: int
    measure_baseline: bool
    port: int = 8020
    # SGLang's CUDA attention back ends are built for 16-bit inputs: a float32 target is served in
    # bf16 here, so its acceptance can differ a little from a float32 vLLM run.
    dtype: str = "bfloat16"

    @classmethod
    def from_evaluate(cls, section: dict[str, Any], **overrides: Any) -> BenchParams:
        shared = {f.name for f in dataclasses.fields(cls)} - {"port", "dtype"}
        return cls(**{key: value for key, value in section.items() if key in shared}, **overrides)


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
    if drafter is None:
        return cmd
    k = params.num_speculative_tokens
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


async def generate(client: httpx.AsyncClient, url: str, input_ids: list[int], params: BenchParams) -> dict[str, Any]:
    response = await client.post(f"{url}/generate", timeout=1800, json={
        "input_ids": input_ids,
        "sampling_params": {"temperature": params.temperature, "max_new_tokens": params.max_new_tokens}})
    response.raise_for_status()
    return response.json()


async def answer_all(url: str, tokenizer: Any, items: list[dict], params: BenchParams,
                     concurrency: int) -> list[dict[str, Any]]:
    """Every question's turns (later turns continue the engine's own answers); each response's meta_info."""
    limit, metas = asyncio.Semaphore(concurrency), []
    async with httpx.AsyncClient() as client:
        async def one(item: dict) -> None:
            answers: list[str] = []
            for _ in item["turns"]:
                ids = render(tokenizer, conversation(item["turns"], answers), True)
                async with limit:
                    body = await generate(client, url, ids, params)
                answers.append(body["text"])
                metas.append(body["meta_info"])
        await asyncio.gather(*(one(item) for item in items))
    return metas


def tokens_per_s(url: str, tokenizer: Any, items: list[dict], params: BenchParams, concurrency: int) -> float:
    first_turns = timed_first_turns(items, params.throughput_prompts, concurrency)
    start = time.monotonic()
    metas = asyncio.run(answer_all(url, tokenizer, first_turns, params, concurrency))
    return round(sum(m["completion_tokens"] for m in metas) / (time.monotonic() - start), 2)


def throughput(url: str, tokenizer: Any, items: list[dict], params: BenchParams) -> dict[str, float]:
    return {"batch1_tokens_per_s": tokens_per_s(url, tokenizer, items, params, 1),
            f"concurrency{params.concurrency}_tokens_per_s": tokens_per_s(url, tokenizer, items, params,
                                                                           params.concurrency)}


def serve(command: list[str], serve_params: server.ServeParams, record: dict[str, Any],
          port: int) -> ServerState:
    # SGLang's first start compiles kernels and captures CUDA graphs: give it twice vLLM's start-up time.
    params = dataclasses.replace(serve_params, port=port, startup_timeout_s=2 * serve_params.startup_timeout_s)
    return server.start(params, record, state_dir=STATE_DIR, command=command)


def questions(params: BenchParams) -> list[dict[str, Any]]:
    items = pq.read_table(EVAL_PROMPTS).to_pylist()[: params.num_questions]
    return [{**item, "turns": item["turns"][: params.turns]} for item in items]


def run(python: str, drafter: Path, params: BenchParams) -> dict[str, Any]:
    from transformers import AutoTokenizer

    exported = export(drafter, OUT_DIR, TARGET_DIR)
    record, serve_params = load_record(TARGET_DIR), load_section("serve", server.ServeParams)
    tokenizer = AutoTokenizer.from_pretrained(TARGET_DIR)
    items = questions(params)
    state = serve(sglang_command(python, serve_params, record, params, OUT_DIR), serve_params, record, params.port)
    try:
        metas = asyncio.run(answer_all(state.url, tokenizer, items, params, params.concurrency))
        result = acceptance(metas, params.num_speculative_tokens)
        result["throughput_with_drafter"] = throughput(state.url, tokenizer, items, params)
    finally:
        server.stop(STATE_DIR)
    if params.measure_baseline:
        state = serve(sglang_command(python, serve_params, record, params, None), serve_params, record, params.port)
        try:
            result["throughput_without_drafter"] = throughput(state.url, tokenizer, items, params)
        finally:
            server.stop(STATE_DIR)
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
    params = BenchParams.from_evaluate(read_params().get("evaluate") or {}, port=args.port, dtype=args.dtype)
    if args.no_baseline:
        params.measure_baseline = False
    start = time.monotonic()
    try:
        result = run(args.python, args.drafter, params)
    except (BenchError, ExportError, ServerError) as err:
        print(f"sglang-bench: {err}", file=sys.stderr)
        return 1
    write_metrics("sglang_bench", time.monotonic() - start, items=result["requests"],
                  tokens=result["generated_tokens"], num_draft_tokens=params.num_speculative_tokens,
                  temperature=params.temperature, **result)
    print(f"sglang-bench: acceptance length {result['acceptance_length']:.3f} at k={params.num_speculative_tokens}, "
          f"T={params.temperature} on {result['questions']} questions ({result['requests']} answers); per position "
          f"{result['per_position']}; tok/s with drafter {result['throughput_with_drafter']}, without "
          f"{result.get('throughput_without_drafter')}; metrics/sglang_bench.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
