"""The target's batched forward with the capture hooks on, and the hand-over of its states to a
store: what the extract stage (hf.py) and the online trainer's capture process share.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from eagle3.extraction.samples import Sample
from eagle3.store.writer import ShardWriter
from eagle3.target.capture import Capture
from eagle3.target.compute import target_dtype
from eagle3.target.record import hub_kwargs


def load_target(record: dict, device: torch.device, device_map: str | None = None) -> Any:
    """The target in `target_dtype` (its own, or float32 on a CPU without instructions for it), on
    `device`, or spread by `device_map` over the GPUs."""
    from transformers import AutoModelForCausalLM

    kwargs = {"device_map": device_map} if device_map else {}
    model = AutoModelForCausalLM.from_pretrained(record["model_path"], dtype=target_dtype(record, device),
                                                 **hub_kwargs(record), **kwargs)
    return (model if device_map else model.to(device)).eval()


def pad_batch(batch: list[Sample], device: torch.device) -> torch.Tensor:
    """Token ids right-padded to the longest sample. No attention mask is needed: under causal
    attention a real position never sees the padding after it, and without a mask the attention
    kernels take their causal path (the same states as a masked forward)."""
    ids = np.zeros((len(batch), len(batch[0].input_ids)), np.int64)
    for row, sample in enumerate(batch):
        ids[row, : len(sample.input_ids)] = sample.input_ids
    return torch.from_numpy(ids).to(device)


def forward_states(model: Any, capture: Capture, batch: list[Sample], device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the decoder (no lm_head): the captured (aux, last) states in bf16, where it ran."""
    with torch.inference_mode():
        model.get_decoder()(input_ids=pad_batch(batch, device), use_cache=False)
        aux, last = (state.to(torch.bfloat16) for state in capture.take())
    return aux, last


def forward_batch(model: Any, capture: Capture, batch: list[Sample], device: torch.device) -> tuple[Any, ...]:
    """Runs the decoder and starts the copies of the captured states to the host."""
    aux, last = forward_states(model, capture, batch, device)
    if device.type != "cuda":
        return aux, last, None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (aux, last)]
    for dst, src in zip(host, (aux, last)):
        dst.copy_(src, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host[0], host[1], event


def state_arrays(sample: Sample, aux: torch.Tensor, last: torch.Tensor) -> dict[str, np.ndarray]:
    """The store's arrays of one sample from its bf16 states on the host ([tokens, ...])."""
    return {"input_ids": sample.input_ids, "loss_mask": sample.loss_mask,
            "aux": aux.view(torch.int16).numpy().view(np.uint16),
            "last": last.view(torch.int16).numpy().view(np.uint16)}


def store_batch(writer: ShardWriter, batch: list[Sample], aux: torch.Tensor, last: torch.Tensor, event: Any) -> None:
    if event is not None:
        event.synchronize()
    for row, sample in enumerate(batch):
        n = len(sample.input_ids)
        writer.put(sample.id, state_arrays(sample, aux[row, :n], last[row, :n]))
