"""Where a training run's states come from: the store, or a capture process beside the trainer
(train.source: online), or that process for the first epoch while it fills a store the later epochs
read (hybrid).

The capture process (eagle3/training/capture_process.py) gets the trainer's batches in the trainer's
order and keeps at most train.prefetch_batches of them ready (eagle3/training/spool.py). If it dies,
it is started again from the batch the trainer is waiting for; if the trainer dies, it resumes from
its checkpoint and a new capture process starts from that checkpoint's batch. The trainer's waits
are counted (stall share), and so are the capture's own seconds (its tokens/s).

The capture is the target's HF forward (train.capture_engine: hf), or the serving engine
(vllm): the extract stage's capture server, which rank 0 starts with the serve section's
parallel sizes (or finds running: `make serve-capture`) and stops at the end of the run, so a
target larger than one GPU is computed with the engine's tensor / expert parallelism and kernels.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from eagle3.engine import server
from eagle3.engine.server import ServeParams
from eagle3.extraction.store import index_and_manifest
from eagle3.store.codec import DEFAULT_LEVEL
from eagle3.store.layout import completed_sample_ids
from eagle3.store.reader import HiddenStore
from eagle3.target.record import hub_kwargs
from eagle3.training import capture_process  # run as its own process; imported so its code is train's dependency
from eagle3.training.data import StoredBatch, batch_loader
from eagle3.training.params import TrainError, TrainParams
from eagle3.training.spool import CaptureJob, batch_path, done_path, empty_dir, read_batch, ready, write_job

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.002
MAX_RESTARTS = 3  # in a row without a batch: the capture cannot start (a bad target, out of memory)
LOG_TAIL_LINES = 20
FILL_ROWS = 64  # samples per job batch when filling the hybrid store (the capture splits them by capture_max_tokens)


@dataclass
class CaptureFigures:
    startup_s: float = 0.0  # the trainer's wait for the run's first batch: the process starting, the target loading
    capture_s: float = 0.0  # the capture process computing them
    captured_tokens: int = 0
    batches: int = 0
    restarts: int = 0
    prefetch_peak_bytes: int = 0
    capture_peak_rss_mb: float = 0.0


@dataclass(frozen=True)
class EngineCapture:
    """train.capture_engine: vllm, what the trainer takes from the other sections: the capture server's
    params, and the extract stage's per-sample timeout (a 1T target's 18K-token prefill outlasts 600 s)."""

    serve: ServeParams
    timeout_s: float  # extract.engine_timeout_s


@dataclass
class CaptureServer:
    """train.capture_engine: vllm, the extract stage's capture server that every rank's capture
    process asks for its batches' states."""

    state_dir: Path
    started: bool  # by this run (rank 0), which stops it when the run ends; else it was running already
    timeout_s: float  # per sample: its request and the hand-over of its states


def connect_capture_server(engine: EngineCapture, record: dict, aux_ids: list[int], state_dir: Path,
                           capture_gpus: int, main: bool, barrier: Callable[[], None]) -> CaptureServer:
    """Rank 0 starts the capture server (on the first capture_gpus GPUs; 0: it shares them with the
    training ranks, within serve.gpu_memory_utilization) or checks the running one: same target,
    same chat template, capturing the aux layers this drafter reads and the last. The other ranks
    wait for it."""
    from transformers import AutoTokenizer

    from eagle3.extraction.engine import captured_layer_ids, clear_spool, connect

    started = False
    if main:
        tokenizer = AutoTokenizer.from_pretrained(record["model_path"], **hub_kwargs(record))
        layer_ids = captured_layer_ids(aux_ids, record["num_layers"])
        state, _, started = connect(engine.serve, record, tokenizer, layer_ids, state_dir, gpus=capture_gpus or None)
        clear_spool(Path(state.capture["spool"]))  # what the requests of a killed capture process left
    barrier()
    return CaptureServer(state_dir, started, engine.timeout_s)


@dataclass
class CaptureProcess:
    """One capture process per trainer rank, fed jobs through its spool directory."""

    spool: Path
    template: CaptureJob  # what every job of this run shares
    log: Path
    server: CaptureServer | None = None  # train.capture_engine: vllm
    figures: CaptureFigures = field(default_factory=CaptureFigures)
    current: CaptureJob | None = None  # the job job.json holds
    process: subprocess.Popen | None = None
    log_file: IO | None = None

    def start(self) -> None:
        self.log_file = self.log_file or open(self.log, "a")
        # the package from wherever this one was imported, whatever the working directory
        path = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen([sys.executable, "-m", capture_process.__name__, str(self.spool)],
                                        stdout=self.log_file, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONPATH": path})

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def submit(self, job: CaptureJob, start: int) -> None:
        job.start = start
        write_job(self.spool, job)
        self.current = job
        if not self.alive():
            self.start()

    def keep_alive(self, job: CaptureJob, seq: int, failures: int) -> int:
        """Starts the process again if it died (from batch `seq`); the failures in a row since the last batch."""
        if self.alive():
            return failures
        code = self.process.returncode if self.process else None
        if failures + 1 >= MAX_RESTARTS:
            self.log_file.flush()
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
            raise TrainError(f"the capture process died {failures + 1} times in a row (last exit code {code}) "
                             f"before batch {seq} of job {job.job}; the end of its output ({self.log}):\n{tail}")
        print(f"[train] capture process exited with code {code}; restarting it at batch {seq}", file=sys.stderr)
        self.figures.restarts += 1
        self.submit(job, seq)
        return failures + 1

    def run(self, batches: list[list[int]], *, spool: bool = True, store_dir: Path | None = None
            ) -> Generator[StoredBatch, None, None]:
        """The states of `batches` in order (spool false: none; the job only fills `store_dir`). Another
        job asked for meanwhile (a held-out evaluation mid-epoch) takes the process; this one is asked
        for again from where it stopped, its ready batches kept."""
        job = dataclasses.replace(self.template, job=(self.current.job if self.current else 0) + 1, batches=batches,
                                  spool=spool, store_dir=str(store_dir) if store_dir else None)
        self.submit(job, 0)
        failures = 0
        for seq in range(len(batches) if spool else 0):
            path, waited = batch_path(self.spool, job.job, seq), time.monotonic()
            if self.current is not job:
                self.submit(job, seq)
            while not path.exists():
                failures = self.keep_alive(job, seq, failures)
                time.sleep(POLL_S)
            self.note_prefetch(job)
            batch, meta = read_batch(path)
            path.unlink()
            failures = 0
            self.account(time.monotonic() - waited, batch, meta)
            yield batch
        self.wait_done(job)

    def wait_done(self, job: CaptureJob) -> None:
        failures = 0
        while not done_path(self.spool, job.job).exists():
            failures = self.keep_alive(job, len(job.batches) if job.spool else 0, failures)
            time.sleep(POLL_S)

    def note_prefetch(self, job: CaptureJob) -> None:
        size = sum(p.stat().st_size for p in ready(self.spool, job.job))
        self.figures.prefetch_peak_bytes = max(self.figures.prefetch_peak_bytes, size)

    def account(self, waited: float, batch: StoredBatch, meta: dict[str, float]) -> None:
        f = self.figures
        f.startup_s = f.startup_s if f.batches else waited
        f.capture_s += meta.get("capture_s", 0.0)
        f.captured_tokens += batch.tokens
        f.batches += 1
        f.capture_peak_rss_mb = max(f.capture_peak_rss_mb, meta.get("capture_rss_mb", 0.0))

    def stop(self) -> None:
        if self.process is None:
            return
        write_job(self.spool, dataclasses.replace(self.template, stop=True))
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.log_file:
            self.log_file.close()
        if self.server and self.server.started:
            server.stop(self.server.state_dir)


def capture_device(device_type: str, local_rank: int, capture_gpus: int) -> str:
    """Where a rank's capture runs: the CPU; its own GPU (capture_gpus 0: both share it); or one of
    the first capture_gpus GPUs, the training ranks taking the GPUs after them (capture_gpu_offset)."""
    if device_type != "cuda":
        return "cpu"
    return f"cuda:{local_rank if capture_gpus == 0 else local_rank % capture_gpus}"


def store_compress_threads() -> int:
    """The hybrid store writer's zstd threads: half of this host's cores shared by its ranks. Two
    threads held the H200's first epoch to 4.7K tokens/s (capture waiting on ~1 GB of compression
    per step); the trainer and the capture's own host work keep the other half."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(2, (os.cpu_count() or 2) // (2 * ranks_here))


def start_capture(params: TrainParams, tokens: Path, target: Path, aux_ids: list[int], run_dir: Path,
                  device_type: str, rank: int, local_rank: int, capture_server: CaptureServer | None = None
                  ) -> CaptureProcess:
    spool = Path(params.prefetch_dir or run_dir / "prefetch") / f"rank{rank}"
    empty_dir(spool)
    template = CaptureJob(job=0, start=0, batches=[], tokens=str(tokens), target=str(target),
                     device=capture_device(device_type, local_rank, params.capture_gpus), aux_layer_ids=aux_ids,
                     capture_max_tokens=params.capture_max_tokens, ttt_steps=params.ttt_steps,
                     max_seq_len=params.max_seq_len, prompt_loss_weight=params.prompt_loss_weight,
                     prefetch=params.prefetch_batches, spool=True, store_dir=None, rank=rank,
                     compress_threads=store_compress_threads(),
                     engine_state_dir=str(capture_server.state_dir) if capture_server else None,
                     **({"engine_timeout_s": capture_server.timeout_s} if capture_server else {}))
    return CaptureProcess(spool, template, run_dir / f"capture-rank{rank}.log", capture_server)


def store_batches(store: HiddenStore, batches: list[list[int]], params: TrainParams, pin_memory: bool
                  ) -> Generator[StoredBatch, None, None]:
    return batch_loader(store, batches, ttt_steps=params.ttt_steps, max_seq_len=params.max_seq_len,
                        prompt_loss_weight=params.prompt_loss_weight, num_workers=params.num_workers,
                        pin_memory=pin_memory)


def fill_hybrid_store(capture: CaptureProcess, root: Path, tokens: HiddenStore, record: dict) -> None:
    """Completes the store the first epoch filled (every sample of `tokens`, in its rows) and
    writes its index and manifest."""
    stored = completed_sample_ids(root)
    rows = [row for row, sample_id in enumerate(tokens.sample_ids) if sample_id not in stored]
    if rows:
        print(f"[train] hybrid: capturing the {len(rows)} samples the first epoch did not store", file=sys.stderr)
        for _ in capture.run([rows[i : i + FILL_ROWS] for i in range(0, len(rows), FILL_ROWS)], spool=False,
                             store_dir=root):
            pass
    index_and_manifest(root, record, tokens.manifest["aux_layer_ids"], DEFAULT_LEVEL, True,
                       {"engine": "vllm" if capture.server else "hf", "filled_by": "train.source: hybrid"})
