"""Extraction tokens/s through HF transformers against the serving engine (extract.engine: hf | vllm),
on the same samples of a built store's inputs, and how close their states are.

The samples (responses and conversations with dataset answers of a pipeline run) are split into
--chunks chunks of about --chunk-tokens tokens; the two paths take turns, chunk by chunk, so both see
the same machine load (the 2-core box is shared). Each chunk's tokens/s is the stage's own
`new_tokens_per_s` (compute only: the HF model load and the server start-up are reported apart);
the record keeps every chunk and the medians. The engine's states are compared with HF's per
position (eagle3/store/compare.py) in the target's own dtype; with --fp32-reference, both paths are also
compared with HF run in float32 on the same chunk (how far each 16-bit path is from exact arithmetic).

  python -m benchmarks.extract_engines --run /work/main --port 8402 --out benchmarks/results/extract-engines-cpu.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from eagle3.engine import server
from eagle3.engine.server import ServeParams
from eagle3.extraction.engine import captured_layer_ids, run_engine_extraction, start_capture_server
from eagle3.extraction.hf import run_extraction
from eagle3.extraction.params import ExtractParams
from eagle3.extraction.samples import resolve_aux_ids
from eagle3.metrics import machine_info
from eagle3.params import load_section
from eagle3.store.compare import compare_stores
from eagle3.store.reader import HiddenStore
from eagle3.target.record import hub_kwargs, load_record


def chunk_inputs(run: Path, work: Path, chunks: int, chunk_tokens: int) -> list[tuple[Path, Path, int]]:
    """(responses, answered, tokens) per chunk: whole rows in file order, responses and answered interleaved."""
    responses = pq.read_table(run / "artifacts/responses/responses.parquet")
    answered = pq.read_table(run / "artifacts/prompts/answered.parquet")
    r_len = [len(p) + len(c) for p, c in zip(responses["prompt_token_ids"].to_pylist(),
                                              responses["completion_token_ids"].to_pylist())]
    a_len = [len(t) for t in answered["token_ids"].to_pylist()]
    out, ri, ai = [], 0, 0
    for k in range(chunks):
        rows_r, rows_a, tokens = [], [], 0
        while tokens < chunk_tokens and (ri < len(r_len) or ai < len(a_len)):
            if ri < len(r_len) and (len(rows_r) <= len(rows_a) / 6 or ai >= len(a_len)):  # ~1 response : 6 answers
                rows_r.append(ri)
                tokens += r_len[ri]
                ri += 1
            else:
                rows_a.append(ai)
                tokens += a_len[ai]
                ai += 1
        folder = work / f"chunk{k}"
        folder.mkdir(parents=True)
        pq.write_table(responses.take(rows_r), folder / "responses.parquet")
        pq.write_table(answered.take(rows_a), folder / "answered.parquet")
        out.append((folder / "responses.parquet", folder / "answered.parquet", tokens))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="a repository whose artifacts/ hold a built run")
    p.add_argument("--chunks", type=int, default=3)
    p.add_argument("--chunk-tokens", type=int, default=8000)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--fp32-reference", action="store_true", help="also HF in float32 on each chunk (untimed)")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    record = load_record(args.run / "artifacts/target")
    record = {**record, "model_path": str((args.run / "artifacts/target").resolve())}
    tokenizer = AutoTokenizer.from_pretrained(record["model_path"], **hub_kwargs(record))
    params = load_section("extract", ExtractParams)
    serve = dataclasses.replace(load_section("serve", ServeParams), port=args.port)
    layer_ids = captured_layer_ids(resolve_aux_ids(params, record), record["num_layers"])
    with tempfile.TemporaryDirectory(prefix="extract-engines-") as tmp:
        work = Path(tmp)
        chunks = chunk_inputs(args.run, work / "inputs", args.chunks, args.chunk_tokens)
        state_dir = work / "server"
        started = time.monotonic()
        start_capture_server(serve, record, layer_ids, state_dir)
        startup_s = time.monotonic() - started
        rows = []
        try:
            for k, (responses, answered, tokens) in enumerate(chunks):
                hf = run_extraction(dataclasses.replace(params, engine="hf"), record, tokenizer, responses,
                                    work / f"hf{k}/hidden", work / f"hf{k}/work", answered)
                eng = run_engine_extraction(dataclasses.replace(params, engine="vllm"), serve, record, tokenizer,
                                            responses, work / f"vllm{k}/hidden", work / f"vllm{k}/work", answered,
                                            state_dir)
                agreement = compare_stores(HiddenStore(work / f"vllm{k}/hidden"), HiddenStore(work / f"hf{k}/hidden"))
                rows.append({"samples": hf["samples"], "tokens": hf["tokens"],
                             "hf_tokens_per_s": hf["new_tokens_per_s"],
                             "engine_tokens_per_s": eng["new_tokens_per_s"], "min_cosine": agreement.min_cosine,
                             "max_rel_error": agreement.max_rel_error, "worst": agreement.worst,
                             "below_0.999": agreement.below, "ids_differ": len(agreement.ids_differ)})
                if args.fp32_reference:
                    run_extraction(dataclasses.replace(params, engine="hf"), {**record, "dtype": "float32"}, tokenizer,
                                   responses, work / f"fp32{k}/hidden", work / f"fp32{k}/work", answered)
                    exact = HiddenStore(work / f"fp32{k}/hidden")
                    for name in ("hf", "vllm"):
                        versus = compare_stores(HiddenStore(work / f"{name}{k}/hidden"), exact)
                        rows[-1][f"{name}_vs_fp32"] = {"min_cosine": versus.min_cosine, "below_0.999": versus.below,
                                                       "max_rel_error": versus.max_rel_error}
                        print(f"chunk {k}: {name} ({record['dtype']}) vs HF float32: {versus.line()}", file=sys.stderr,
                              flush=True)
                print(f"chunk {k}: {hf['tokens']} tokens, hf {hf['new_tokens_per_s']} tok/s, vllm "
                      f"{eng['new_tokens_per_s']} tok/s; {agreement.line()}", file=sys.stderr, flush=True)
        finally:
            server.stop(state_dir)
    tokens = sum(r["tokens"] for r in rows)
    samples = sum(r["samples"] for r in rows)
    result = {"benchmark": "extract_engines", "machine": machine_info(), "dtype": record["dtype"],
              "geometry": {"hidden_size": record["hidden_size"], "vocab_size": record["vocab_size"],
                           "num_layers": record["num_layers"]},
              "tokens": statistics.median(r["tokens"] for r in rows), "mean_seq": tokens / samples,
              "hf_tokens_per_s": statistics.median(r["hf_tokens_per_s"] for r in rows),
              "engine_tokens_per_s": statistics.median(r["engine_tokens_per_s"] for r in rows),
              "engine_startup_s": round(startup_s, 1), "engine_concurrency": params.engine_concurrency,
              "hf_max_tokens_per_batch": params.max_tokens_per_batch,
              "min_cosine": {n: min(r["min_cosine"][n] for r in rows) for n in rows[0]["min_cosine"]},
              "max_rel_error": {n: max(r["max_rel_error"][n] for r in rows) for n in rows[0]["max_rel_error"]},
              "below_0.999": {n: sum(r["below_0.999"][n] for r in rows) for n in rows[0]["below_0.999"]},
              "positions": tokens, "chunks": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "chunks"}, indent=2))


if __name__ == "__main__":
    main()
