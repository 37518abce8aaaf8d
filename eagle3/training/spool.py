"""The prefetch spool between the trainer and its capture process: the job the trainer asks for and
the batches of states the capture process hands back, as files in one directory.

  job.json                        what to capture: the batches (rows of the token store), in the
                                  trainer's order, from `start` on; a new job or start supersedes it
  j{job}-b{seq}.safetensors       batch `seq` of job `job`, collated as the store's reader collates
                                  (eagle3/training/data.py StoredBatch); removed once the trainer has it
  j{job}-done                     the job is complete (its store writes too, in hybrid mode)

Files rather than a pipe: no pickle crosses between the processes (safetensors and JSON only), a
batch is complete or absent (written under a temporary name, then renamed), and whatever a killed
capture process had finished stays usable by its successor. At most `prefetch` batch files exist at
a time, which bounds the buffer's memory (on tmpfs) or disk.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.atomic import atomic_write_text
from eagle3.store.reader import StatePlanes
from eagle3.training.data import StoredBatch

JOB_NAME = "job.json"


@dataclass
class CaptureJob:
    job: int
    start: int  # first batch to produce; batches before it the trainer already has
    batches: list[list[int]]  # rows of the token store, per batch, in the trainer's order
    tokens: str  # the store whose token ids are captured (artifacts/hidden: tokens only, or a full store)
    target: str  # the target's directory (artifacts/target)
    device: str  # cpu | cuda:N: where the capture's forward runs
    aux_layer_ids: list[int]
    capture_max_tokens: int  # padded tokens per capture forward: a trainer batch may take several
    ttt_steps: int
    max_seq_len: int
    prompt_loss_weight: float
    prefetch: int  # batch files ready at most
    spool: bool  # false: only the store writes (hybrid's filling of samples no training batch captured)
    store_dir: str | None  # hybrid: each captured sample's states also go into this store
    rank: int
    compress_threads: int = 2  # hybrid: the store writer's zstd threads
    engine_state_dir: str | None = None  # train.capture_engine vllm: the capture server's state (run/server)
    engine_timeout_s: float = 600.0  # per sample: its request and the hand-over of its states
    stop: bool = False


def write_job(spool: Path, job: CaptureJob) -> None:
    atomic_write_text(spool / JOB_NAME, json.dumps(dataclasses.asdict(job)))


def read_job(spool: Path) -> CaptureJob | None:
    try:
        return CaptureJob(**json.loads((spool / JOB_NAME).read_text()))
    except FileNotFoundError:
        return None


def batch_path(spool: Path, job: int, seq: int) -> Path:
    return spool / f"j{job}-b{seq:08d}.safetensors"


def done_path(spool: Path, job: int) -> Path:
    return spool / f"j{job}-done"


def ready(spool: Path, job: int) -> list[Path]:
    return sorted(spool.glob(f"j{job}-b*.safetensors"))


def write_batch(path: Path, batch: StoredBatch, meta: dict[str, float]) -> None:
    tensors = {"aux_top": batch.aux.top, "aux_low": batch.aux.low, "next_ids": batch.next_ids,
               "last_top": batch.next_last.top, "last_low": batch.next_last.low, "next_weight": batch.next_weight}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp,
              metadata={"tokens": str(batch.tokens), **{k: repr(v) for k, v in meta.items()}})
    os.replace(tmp, path)


def read_batch(path: Path) -> tuple[StoredBatch, dict[str, float]]:
    """The batch and its capture figures (seconds, tokens, the capture process's peak RSS)."""
    with safe_open(path, framework="pt") as f:
        meta = {k: float(v) for k, v in (f.metadata() or {}).items()}
        t = {name: f.get_tensor(name) for name in f.keys()}
    batch = StoredBatch(StatePlanes(t["aux_top"], t["aux_low"]), t["next_ids"],
                        StatePlanes(t["last_top"], t["last_low"]), t["next_weight"], tokens=int(meta.pop("tokens")))
    return batch, meta


def empty_dir(spool: Path) -> None:
    """A spool with nothing in it: batches of an earlier run are cheaper to capture again than to trust."""
    spool.mkdir(parents=True, exist_ok=True)
    for path in spool.iterdir():
        if path.is_file():
            path.unlink()

