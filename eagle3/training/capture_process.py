"""The online capture process: the target's states for the trainer's batches, in the trainer's order,
into the prefetch spool (eagle3/training/spool.py); in hybrid mode every captured sample also goes
into a store.

    python -m eagle3.training.capture_process SPOOL_DIR

The trainer starts it (eagle3/training/online.py), and starts it again if it dies: the new process
reads the same job.json, whose `start` the trainer has moved to the first batch it still needs, and
skips the batch files already there. The forward is the extract stage's (eagle3/extraction/hf.py:
the same hooks, bf16 states), so online states are the stored ones up to the batch composition's
effect on the kernels. The process leaves when the trainer is gone or the job says stop.

With train.capture_engine: vllm the states come from the capture server the trainer started (the
extract stage's: eagle3/extraction/engine.py, with the serve section's tensor / data / expert
parallel sizes), which this process asks for each batch's samples; the spool, the hybrid store and
the restarts are the same.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from eagle3.extraction.forward import forward_states, load_target, state_arrays
from eagle3.extraction.samples import Sample, length_batches
from eagle3.store.layout import completed_sample_ids
from eagle3.store.reader import HiddenStore, StatePlanes
from eagle3.store.writer import ShardWriter
from eagle3.target.capture import Capture
from eagle3.training.data import collate
from eagle3.training.spool import CaptureJob, batch_path, done_path, read_job, ready, write_batch

POLL_S = 0.005


class Superseded(Exception):
    """job.json now asks for something else: drop this job's work and read it again."""


StatesOf = Callable[[list[Sample]], Iterable[tuple[Sample, torch.Tensor, torch.Tensor]]]


def target_states(job: CaptureJob) -> StatesOf:
    """What computes the states: the target's HF forward here, with the extract stage's hooks, in
    forwards of at most capture_max_tokens padded tokens; or the running capture server
    (train.capture_engine: vllm), which batches a trainer batch's samples as it schedules them."""
    from eagle3.target.record import load_record

    record = load_record(Path(job.target))
    if job.engine_state_dir:
        from eagle3.engine.state import running_server
        from eagle3.extraction.engine import capture_samples, captured_layer_ids

        state = running_server(Path(job.engine_state_dir))
        if state is None:
            raise RuntimeError(f"no capture server is running (state in {job.engine_state_dir}); the trainer starts it")
        layer_ids = captured_layer_ids(job.aux_layer_ids, record["num_layers"])
        return lambda samples: capture_samples(state, state.model, layer_ids, job.aux_layer_ids,
                                               record["num_layers"], samples, job.engine_timeout_s)
    device = torch.device(job.device)
    model = load_target(record, device)
    capture = Capture(model, job.aux_layer_ids)

    def forward(samples: list[Sample]) -> Iterable[tuple[Sample, torch.Tensor, torch.Tensor]]:
        for group in length_batches(samples, job.capture_max_tokens):
            aux, last = forward_states(model, capture, group, device)
            for row, sample in enumerate(group):
                yield sample, aux[row, : len(sample.input_ids)], last[row, : len(sample.input_ids)]

    return forward


def still_wanted(spool: Path, job: CaptureJob, parent: int) -> None:
    if os.getppid() != parent:
        sys.exit(0)  # the trainer is gone: nobody will read what this process makes
    current = read_job(spool)
    if current is None or (current.job, current.start, current.stop) != (job.job, job.start, job.stop):
        raise Superseded


def capture_batch(states_of: StatesOf, samples: list[Sample], writer: ShardWriter | None, stored: set[str]
                  ) -> dict[str, dict]:
    """Each sample's token ids, mask and states as StatePlanes; in hybrid mode the samples not yet
    stored also go into the store. The planes are split where the states are (on a GPU, a few
    kernels instead of host CPU work)."""
    out = {}
    for sample, aux, last in states_of(samples):
        if writer is not None and sample.id not in stored:
            writer.put(sample.id, state_arrays(sample, aux.cpu(), last.cpu()))
            stored.add(sample.id)
        aux_planes, last_planes = StatePlanes.of(aux), StatePlanes.of(last)
        out[sample.id] = {"input_ids": torch.from_numpy(sample.input_ids),
                          "loss_mask": torch.from_numpy(sample.loss_mask),
                          "aux": StatePlanes(aux_planes.top.cpu(), aux_planes.low.cpu()),
                          "last": StatePlanes(last_planes.top.cpu(), last_planes.low.cpu())}
    return out


def run_job(spool: Path, job: CaptureJob, states_of: StatesOf, parent: int) -> None:
    tokens = HiddenStore(job.tokens)
    writer, stored = None, set()
    if job.store_dir:
        stored = completed_sample_ids(job.store_dir)
        # small shards: a crash loses at most one uncommitted shard, which the filling then captures again
        writer = ShardWriter(job.store_dir, rank=job.rank, shard_bytes=64 << 20, threads=job.compress_threads)
    try:
        for seq in range(job.start, len(job.batches)):
            path = batch_path(spool, job.job, seq)
            if job.spool and path.exists():
                continue  # made by a predecessor that died later
            while job.spool and len(ready(spool, job.job)) >= job.prefetch:
                still_wanted(spool, job, parent)
                time.sleep(POLL_S)
            still_wanted(spool, job, parent)
            started = time.monotonic()
            rows = job.batches[seq]
            samples = [sample_at(tokens, row) for row in rows]
            if not job.spool:  # filling the store: only what it lacks
                samples = [s for s in samples if s.id not in stored]
            states = capture_batch(states_of, samples, writer, stored)
            if job.spool:
                batch = collate([states[s.id] for s in samples], ttt_steps=job.ttt_steps, max_seq_len=job.max_seq_len,
                                prompt_loss_weight=job.prompt_loss_weight)
                write_batch(path, batch, {"capture_s": time.monotonic() - started,
                                          "capture_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
        if writer is not None:
            writer.close()  # the last shard is committed before the job says it is done
            writer = None
        done_path(spool, job.job).touch()
    finally:
        if writer is not None:
            writer.close()
        tokens.close()


def sample_at(tokens: HiddenStore, row: int) -> Sample:
    arrays = tokens.read_row(row).arrays
    return Sample(tokens.sample_ids[row], arrays["input_ids"], arrays["loss_mask"])


def main(argv: list[str]) -> int:
    spool, parent = Path(argv[0]), os.getppid()
    states_of, finished = None, None
    while True:
        job = read_job(spool)
        if job is not None and job.stop:
            return 0
        if job is None or (job.job, job.start) == finished or done_path(spool, job.job).exists():
            if os.getppid() != parent:
                return 0
            time.sleep(POLL_S)
            continue
        states_of = states_of or target_states(job)
        try:
            run_job(spool, job, states_of, parent)
            finished = (job.job, job.start)
        except Superseded:
            continue


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
