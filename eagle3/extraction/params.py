"""The extract stage's params and errors."""
from __future__ import annotations

from dataclasses import dataclass

from eagle3.errors import PipelineError

OVER_LENGTH = ("truncate", "skip")
ENGINES = ("hf", "vllm")
STORE_DTYPES = ("bf16", "fp8_e4m3")  # how the states are stored (eagle3/store/codec.py); both read back as bf16
# train.source: where the trainer's states come from; all but "store" leave extract storing token ids only
TRAIN_SOURCES = ("store", "online", "hybrid")


class ExtractError(PipelineError, ValueError):
    pass


@dataclass
class ExtractParams:
    aux_layer_ids: list[int] | None  # None: the target's default (2, N//2, N-3)
    max_seq_len: int
    over_length: str  # truncate | skip
    max_tokens_per_batch: int  # padded tokens per forward
    zstd_level: int
    store_dtype: str  # bf16: lossless | fp8_e4m3: float8 with a scale per token and layer (lossy, 0.43 of bf16's bytes)
    shard_mb: float
    compress_threads: int
    device: str  # auto | cpu | cuda
    device_map: str | None  # "auto": spread a target larger than one GPU over all of them
    # hf: the target in transformers (device, device_map); vllm: the serving engine captures the states
    # (the `serve` section's parallel sizes), eagle3/extraction/engine.py
    engine: str
    engine_concurrency: int  # vllm: samples in flight (each one prefill of the whole sequence)
    engine_timeout_s: float  # vllm: per sample, request and the hand-over of its states together
