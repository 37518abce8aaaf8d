"""A KV connector that runs inside vLLM and hands each captured request's hidden states to the
extract stage through a spool directory (loaded by vLLM via `kv_connector_module_path`).

vLLM's `extract_hidden_states` speculative method runs the target and writes, for every scheduled
token, the states at the layer ids of its draft config (vLLM's convention: id X = hidden + residual
after decoder layer X-1, id N = the last layer's output before the final norm) into a cache-only
attention layer's KV cache. When a request finishes, the connector reads that request's slots.
vLLM's example connector (ExampleHiddenStatesConnector) does so with CUDA streams and events, which
fail on CPU; this subclass keeps its scheduler side (request -> file name, block freeing delayed
until the states are read) and replaces the worker-side copy: a plain device-to-host copy (TP rank
0 only; after each decoder layer's all-reduce every TP rank holds the full state) and an atomic
write in a writer thread, so the stage never sees half a file.

Only requests that ask for it (`kv_transfer_params: {"eagle3_capture": true}`) are captured, so the
same server can answer ordinary requests without spooling anything.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

CAPTURE_FLAG = "eagle3_capture"


class _Copied:
    """Stands in for the example connector's CUDA event: the host copy is complete on return."""

    @staticmethod
    def query() -> bool:
        return True


def _write_atomically(tensors: dict[str, torch.Tensor], filename: str) -> None:
    tmp = f"{filename}.{os.getpid()}.tmp"
    try:
        save_file(tensors, tmp)
        os.replace(tmp, filename)
    except BaseException as err:
        # The stage waits for the file or this note; never for a file that will not come.
        with open(f"{filename}.error", "w") as f:
            json.dump({"error": f"{type(err).__name__}: {err}"}, f)
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class SpoolHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector without CUDA streams, capturing only requests that ask."""

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if not (request.kv_transfer_params or {}).get(CAPTURE_FLAG):
            self._request_filenames.pop(request.request_id, None)
            return False, None  # an ordinary request: free its blocks now, write nothing
        return super().request_finished(request, block_ids)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), pending.token_ids.shape[0])
        # [tokens, states, hidden] in the order of the draft config's layer ids
        tensors = {"hidden_states": states.to("cpu").contiguous(), "token_ids": pending.token_ids.to(torch.int64)}
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        future = self._executor.submit(_write_atomically, tensors, pending.filename)
        self._req_copy_events[pending.req_id] = _Copied()
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, req_id=pending.req_id: self._on_write_done(req_id, f))
