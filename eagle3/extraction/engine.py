"""Extraction through the serving engine: vLLM computes the states, our store keeps them.

The server is the one `generate` uses (eagle3/engine/server.py: 127.0.0.1, pidfile under
run/server/, stopped on SIGTERM, the `serve` section's tensor/data parallel sizes), started with
vLLM's `extract_hidden_states` speculative method and our KV connector
(eagle3/engine/hidden_connector.py). Each sample goes out as its token ids (prompt + completion,
nothing re-rendered) in a completion request for one token; vLLM's prefill runs the whole sequence
and its model records, per position, the states at the draft config's layer ids: the aux ids and N
(the target's layer count). In vLLM's convention (models/llama.py, `_maybe_add_hidden_state`) id X
is hidden + residual after decoder layer X-1, so id N is the last layer's output before the final
norm: the store's `last` (`last_state: pre_norm`), exactly what the HF path hooks. The connector
spools each request's states to one file under run/server/spool/, written atomically; this module
checks the token ids, puts the sample into the shard writer and deletes the file, so the store,
its manifest, resume and the skip/truncate rules are the HF path's (eagle3/extraction/store.py).
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from eagle3.engine import server
from eagle3.engine.client import check_served_model
from eagle3.engine.state import STATE_DIR, ServerError, ServerState, pid_alive, running_server
from eagle3.extraction.forward import state_arrays
from eagle3.extraction.params import ExtractError, ExtractParams
from eagle3.extraction.samples import Sample
from eagle3.extraction.store import Work, finish_store, plan_work, store_writer
from eagle3.metrics import gpus
from eagle3.progress import Progress
from eagle3.store.writer import ShardWriter
from eagle3.target.compute import served_dtype

CAPTURE_FLAG = "eagle3_capture"  # the connector captures only requests carrying it (hidden_connector.py)
SPOOL_POLL_S = 0.02
RETRIES = 3  # per sample, on a connection error or 5xx while the engine process is alive


def captured_layer_ids(aux_ids: list[int], num_layers: int) -> list[int]:
    """The ids vLLM is asked for: the aux ids and N (the last layer's pre-norm output). vLLM returns
    them in layer order, once each (an aux id equal to N is captured once)."""
    return sorted(set(aux_ids) | {num_layers})


def capture_args(layer_ids: list[int], spool: Path) -> list[str]:
    """vLLM arguments that make a server capture `layer_ids` for requests that ask for it. Prefix
    caching is off: a cached prefix is not recomputed, and its states would come from the cache
    blocks of whichever request computed it first."""
    # Imported here (it imports vLLM) so that the stage's code deps include the connector vLLM runs.
    from eagle3.engine import hidden_connector

    connector = hidden_connector.SpoolHiddenStatesConnector
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
    transfer = {"kv_connector": connector.__name__, "kv_connector_module_path": connector.__module__,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(spool), "use_synchronization_lock": False}}
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(transfer),
            "--no-enable-prefix-caching"]


def capture_state(layer_ids: list[int], state_dir: Path) -> dict[str, Any]:
    """What a capturing server records in its state file (run/server/server.json)."""
    return {"layer_ids": layer_ids, "spool": str((state_dir / "spool").resolve())}


def check_parallel_sizes(serve: server.ServeParams, found: list[str]) -> None:
    needed = serve.tensor_parallel_size * serve.data_parallel_size
    if found and needed > len(found):
        raise ServerError(f"serve.tensor_parallel_size={serve.tensor_parallel_size} x data_parallel_size="
                          f"{serve.data_parallel_size} needs {needed} GPUs; this machine has {len(found)} "
                          f"({', '.join(sorted(set(found)))})")


def check_running(state: ServerState, want: dict[str, Any], record: dict[str, Any]) -> None:
    """Refuse a running server that does not capture what this extraction stores."""
    where = f"the running server (pid {state.pid}, {state.url}, log {state.log})"
    if not server_same_path(state.model_path, record["model_path"]):
        raise ServerError(f"{where} serves {state.model_path!r}, but artifacts/target is {record['model_path']!r}; "
                          "`make stop` first")
    if state.capture is None:
        raise ServerError(f"{where} was started without hidden-state capture (`make serve` or the generate stage); "
                          "`make stop` first, or start it with `make serve-capture`")
    if state.capture["layer_ids"] != want["layer_ids"]:
        raise ServerError(f"{where} captures layer ids {state.capture['layer_ids']}, this extraction needs "
                          f"{want['layer_ids']} (extract.aux_layer_ids and the last layer {record['num_layers']}); "
                          "`make stop` first")


def server_same_path(served: str, expected: str) -> bool:
    return Path(served).resolve() == Path(expected).resolve() if Path(expected).exists() else served == expected


def start_capture_server(serve: server.ServeParams, record: dict[str, Any], layer_ids: list[int],
                         state_dir: Path = STATE_DIR, gpus_used: int | None = None) -> ServerState:
    """Start vLLM for the target with capture on (what `make serve-capture` runs); on the first
    `gpus_used` GPUs only where given (the online trainer's capture_gpus; its ranks take the rest)."""
    found = gpus()[:gpus_used] if gpus_used else gpus()
    check_parallel_sizes(serve, found)
    want = capture_state(layer_ids, state_dir)
    command = server.server_command(serve, record, bool(found)) + capture_args(layer_ids, Path(want["spool"]))
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(len(found))))} if gpus_used and found else None
    return server.start(serve, record, state_dir, command=command, capture=want, env=env)


def connect(serve: server.ServeParams, record: dict[str, Any], tokenizer: Any, layer_ids: list[int],
            state_dir: Path, gpus: int | None = None) -> tuple[ServerState, dict[str, Any], bool]:
    """(server, served model entry, whether we started it and must stop it); a server we start
    takes the first `gpus` GPUs where given (start_capture_server)."""
    running = running_server(state_dir)
    if running:
        check_running(running, capture_state(layer_ids, state_dir), record)
        print(f"extract: using the running capture server {running.url} (pid {running.pid})", file=sys.stderr)
    state = running or start_capture_server(serve, record, layer_ids, state_dir, gpus)
    try:
        entry = server.wait_healthy(state.url, serve.startup_timeout_s, alive=lambda: pid_alive(state.pid))
        check_served_model(state.url, entry, record, tokenizer)
    except BaseException:
        if not running:
            server.stop(state_dir)
        raise
    return state, entry, running is None


@dataclass
class Context:
    url: str
    model: str
    state: ServerState
    layer_ids: list[int]
    aux_ids: list[int]
    num_layers: int
    timeout_s: float
    client: httpx.AsyncClient

    def engine_gone(self, sample: Sample, what: str) -> ServerError:
        return ServerError(f"the engine (pid {self.state.pid}, {self.state.url}) died {what} sample {sample.id}; "
                           f"the samples stored so far are kept: rerun to resume (log {self.state.log})")


async def request_states(ctx: Context, sample: Sample, deadline: float) -> Path:
    """Sends one sample; returns the path its states are spooled to."""
    body = {"model": ctx.model, "prompt": sample.input_ids.tolist(), "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {CAPTURE_FLAG: True}}
    for attempt in range(RETRIES + 1):
        try:
            response = await ctx.client.post(f"{ctx.url}/v1/completions", json=body,
                                             timeout=max(deadline - time.monotonic(), 1.0))
        except httpx.TransportError as err:
            if not pid_alive(ctx.state.pid):
                raise ctx.engine_gone(sample, "while computing") from None
            error = f"{type(err).__name__}: {err}"
        else:
            if response.status_code == 200:
                params = response.json().get("kv_transfer_params") or {}
                if "hidden_states_path" not in params:
                    raise ServerError(f"{ctx.url} answered sample {sample.id} without kv_transfer_params."
                                      "hidden_states_path: the server does not capture hidden states")
                return Path(params["hidden_states_path"])
            if response.status_code < 500:  # the engine refused this sample (too long, ...): never retried
                raise ExtractError(f"the engine refused sample {sample.id} ({len(sample.input_ids)} tokens): "
                                   f"{response.status_code} {response.text[:300]}")
            error = f"{response.status_code} {response.text[:200]}"
        if attempt == RETRIES or time.monotonic() > deadline:
            raise ServerError(f"{ctx.url}: sample {sample.id} failed {attempt + 1} times, last: {error}")
        await asyncio.sleep(min(2 ** attempt, 10) * (0.5 + random.random()))
    raise AssertionError("unreachable")


async def spooled_states(ctx: Context, sample: Sample, path: Path, deadline: float) -> dict[str, Any]:
    """Waits for the connector's file (it is written after the answer, in the engine's next step)."""
    from safetensors.torch import load_file

    error = Path(f"{path}.error")
    while not path.exists():
        if error.exists():
            raise ServerError(f"the engine could not spool sample {sample.id}: {error.read_text()[:300]}")
        if not pid_alive(ctx.state.pid):
            raise ctx.engine_gone(sample, "before it handed over the states of")
        if time.monotonic() > deadline:
            raise ServerError(f"the engine did not hand over the states of sample {sample.id} within "
                              f"extract.engine_timeout_s (expected {path})")
        await asyncio.sleep(SPOOL_POLL_S)
    tensors = load_file(path)  # safetensors: no pickle
    path.unlink()
    return tensors


def engine_states(ctx: Context, sample: Sample, tensors: dict[str, Any]) -> tuple[Any, Any]:
    """(aux [tokens, aux layers x hidden], last [tokens, hidden]) bf16 of one sample from the
    engine's [tokens, layers, hidden] states, checked against the ids sent."""
    import torch

    ids = tensors["token_ids"].numpy()
    if not np.array_equal(ids, sample.input_ids):
        raise ExtractError(f"the engine returned the states of other token ids for sample {sample.id} "
                           f"({len(ids)} ids against {len(sample.input_ids)} sent)")
    states = tensors["hidden_states"]
    if states.ndim != 3 or states.shape[:2] != (len(ids), len(ctx.layer_ids)):
        raise ExtractError(f"the engine returned states of shape {tuple(states.shape)} for sample {sample.id}; "
                           f"expected ({len(ids)}, {len(ctx.layer_ids)}, hidden): does the server capture "
                           f"layer ids {ctx.layer_ids}?")
    states = states.to(torch.bfloat16)
    aux = states[:, [ctx.layer_ids.index(i) for i in ctx.aux_ids]].reshape(len(ids), -1).contiguous()
    return aux, states[:, ctx.layer_ids.index(ctx.num_layers)].contiguous()


async def samples_states(ctx: Context, samples: list[Sample], concurrency: int) -> AsyncIterator[tuple[Sample, Any, Any]]:
    """Each sample with its (aux, last) states (engine_states), in the order the engine finishes them."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(sample: Sample) -> tuple[Sample, dict[str, Any]]:
        async with semaphore:
            deadline = time.monotonic() + ctx.timeout_s
            path = await request_states(ctx, sample, deadline)
            return sample, await spooled_states(ctx, sample, path, deadline)

    tasks = [asyncio.ensure_future(one(s)) for s in samples]
    try:
        for finished in asyncio.as_completed(tasks):
            sample, tensors = await finished
            yield sample, *engine_states(ctx, sample, tensors)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def capture_all(ctx: Context, todo: list[Sample], writer: ShardWriter, progress: Progress,
                      concurrency: int) -> None:
    async for sample, aux, last in samples_states(ctx, todo, concurrency):
        writer.put(sample.id, state_arrays(sample, aux, last))
        progress.update(len(sample.input_ids), extra=f"stored/raw {writer.stats.stored_over_raw:.3f}")


def capture_samples(state: ServerState, model: str, layer_ids: list[int], aux_ids: list[int], num_layers: int,
                    samples: list[Sample], timeout_s: float) -> list[tuple[Sample, Any, Any]]:
    """The states of `samples` from a running capture server, all in flight at once (the engine
    batches them): what the online trainer's capture process asks for one batch."""

    async def run() -> list[tuple[Sample, Any, Any]]:
        limits = httpx.Limits(max_connections=len(samples), max_keepalive_connections=len(samples))
        async with httpx.AsyncClient(limits=limits) as client:
            ctx = Context(state.url, model, state, layer_ids, aux_ids, num_layers, timeout_s, client)
            return [item async for item in samples_states(ctx, samples, len(samples))]

    return asyncio.run(run()) if samples else []


def clear_spool(spool: Path) -> None:
    """Files of requests an interrupted run never read: they are recomputed, never trusted."""
    if spool.is_dir():
        for path in spool.iterdir():
            path.unlink(missing_ok=True)


def run_engine_extraction(params: ExtractParams, serve: server.ServeParams, record: dict[str, Any], tokenizer: Any,
                          responses: Path, out: Path, work_root: Path, answered: Path | None = None,
                          state_dir: Path = STATE_DIR) -> dict[str, Any]:
    import vllm

    computes = served_dtype(record, bool(gpus()))
    # States of another compute dtype never resume into this store (a CPU without bf16 serves float32).
    key = {"engine": "vllm"} if computes == record["dtype"] else {"engine": "vllm", "compute_dtype": computes}
    # One position of the context is the generated token: a sample may use max_model_len - 1.
    work: Work = plan_work(params, record, tokenizer, responses, answered, work_root,
                           max_len=serve.max_model_len - 1, extra_key=key)
    layer_ids = captured_layer_ids(work.aux_ids, record["num_layers"])
    if work.counts.get("engine_limited"):
        print(f"extract: {work.counts['engine_limited']} samples longer than serve.max_model_len - 1 = "
              f"{serve.max_model_len - 1} (and within extract.max_seq_len) were "
              f"{'truncated' if params.over_length == 'truncate' else 'skipped'} (extract.over_length)",
              file=sys.stderr)
    total = sum(len(s.input_ids) for s in work.share)
    done = total - sum(len(s.input_ids) for s in work.todo)
    print(f"extract: vLLM {vllm.__version__}: {len(work.samples)} samples, {len(work.samples) - len(work.todo)} "
          f"already stored in {work.dir}; capturing layer ids {layer_ids} (aux {work.aux_ids}, last = "
          f"{record['num_layers']}, pre-norm)", file=sys.stderr)
    start = time.monotonic()
    progress = Progress("extract", total=total, unit="tokens", done=done)
    if work.todo:
        state, entry, started = connect(serve, record, tokenizer, layer_ids, state_dir)
        try:
            clear_spool(Path(state.capture["spool"]))
            start = time.monotonic()  # the rate counts the engine's work, not its start-up
            progress = Progress("extract", total=total, unit="tokens", done=done)
            writer = store_writer(params, work, record)
            with writer:
                asyncio.run(run_capture(params, state, entry, layer_ids, work, record, writer, progress))
        finally:
            if started:
                server.stop(state_dir)
    compute_s = time.monotonic() - start
    new_tokens = progress.done - progress.start_done
    summary = {"new_tokens": new_tokens, "new_tokens_per_s": round(new_tokens / max(compute_s, 1e-9), 1),
               **work.counts, "aux_layer_ids": work.aux_ids, "engine": "vllm", "engine_version": vllm.__version__,
               "compute_dtype": computes}
    return summary | finish_store(work, out, record, params,
                                  extra={"engine": "vllm", "engine_version": vllm.__version__,
                                         "engine_layer_ids": layer_ids, "compute_dtype": computes})


async def run_capture(params: ExtractParams, state: ServerState, entry: dict[str, Any], layer_ids: list[int],
                      work: Work, record: dict[str, Any], writer: ShardWriter, progress: Progress) -> None:
    limits = httpx.Limits(max_connections=params.engine_concurrency,
                          max_keepalive_connections=params.engine_concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        ctx = Context(state.url, entry["id"], state, layer_ids, work.aux_ids, record["num_layers"],
                      params.engine_timeout_s, client)
        await capture_all(ctx, work.todo, writer, progress, params.engine_concurrency)
