"""Which samples train together, and how a sample's arrays line up with the drafter's TTT steps.

Alignment (docs/stages.md, "train"): anchor t reads the target's aux states at t. TTT step k feeds
the embedding of token t+1+k and learns the target's next-token distribution at position t+1+k
(from the target's `last` state there), i.e. it predicts token t+2+k; it is valid while
t+1+k < T. Step 0 is what vLLM's proposer does first: the states of the last verified position
plus the token just sampled from them. So a batch holds the anchors' aux states (L = T-1
anchors) and "next" arrays whose column j = t+k holds what position j+1 contributes; step k
reads columns k .. k+L-1 of them (`Batch.step`).

Batching: one sample per row, right-padded. The TTT attention is causal plus diagonals, so a
real position never sees the padding after it; packing several samples into one row would
need a document mask that attention does not have. A batch holds at most max_tokens_per_batch
padded tokens. An optimizer step takes batches_per_step batches from a plan that depends only
on the store's index, the seed and the epoch, never on the world size: the ranks split each
step's batches, so 1 or N processes train on identical global batches.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import sys
from collections.abc import Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from eagle3.store.reader import HiddenStore, StoredStates, to_torch
from eagle3.training.params import TrainError, TrainParams


def is_heldout(sample_id: str, fraction: float) -> bool:
    """Held-out membership from the sample id alone: stable across runs, seeds and params."""
    digest = hashlib.sha256(sample_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def pack(rows: Sequence[int], lengths: np.ndarray, max_tokens: int) -> list[list[int]]:
    """Consecutive rows into batches whose padded size (rows x longest) stays within max_tokens."""
    batches: list[list[int]] = []
    longest = 0
    for row in rows:
        n = int(lengths[row])
        if batches and (len(batches[-1]) + 1) * max(longest, n) <= max_tokens:
            batches[-1].append(int(row))
            longest = max(longest, n)
        else:
            batches.append([int(row)])
            longest = n
    return batches


def epoch_steps(
    rows: np.ndarray,
    lengths: np.ndarray,
    *,
    seed: int,
    epoch: int,
    max_tokens: int,
    length_group: int,
    batches_per_step: int,
) -> list[list[list[int]]]:
    """One epoch's optimizer steps, each a list of batches (lists of index rows).

    Shuffled by (seed, epoch). Each window of `length_group` shuffled samples is sorted by length
    before packing, so a batch holds similar lengths (little padding) while the epoch stays
    shuffled; the batches are shuffled again. Batches that do not fill a last step are dropped
    (different ones each epoch).
    """
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(rows)
    grouped = [
        row
        for start in range(0, len(order), length_group)
        for row in sorted(order[start : start + length_group], key=lambda r: -lengths[r])
    ]
    batches = pack(grouped, lengths, max_tokens)
    batches = [batches[i] for i in rng.permutation(len(batches))]
    usable = len(batches) - len(batches) % batches_per_step
    return [batches[i : i + batches_per_step] for i in range(0, usable, batches_per_step)]


@dataclass
class Plan:
    epochs: list[list[list[list[int]]]]  # epoch -> step -> batch -> index rows
    heldout: list[list[int]]  # held-out batches
    lengths: np.ndarray  # tokens of each index row after the cut to max_seq_len
    train_samples: int
    heldout_samples: int

    @property
    def total_steps(self) -> int:
        return sum(len(steps) for steps in self.epochs)

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within it) of global step `step`; (epochs, 0) once all are done."""
        for epoch, steps in enumerate(self.epochs):
            if step < len(steps):
                return epoch, step
            step -= len(steps)
        return len(self.epochs), 0

    def tokens(self, batches: Sequence[Sequence[int]]) -> int:
        return int(sum(self.lengths[row] for batch in batches for row in batch))

    def padding_fraction(self) -> float:
        """Share of the training batches' padded tokens (rows x longest) that are padding."""
        batches = [batch for steps in self.epochs for step in steps for batch in step]
        padded = sum(len(batch) * int(self.lengths[batch].max()) for batch in batches)
        return 1 - self.tokens(batches) / padded


def make_plan(params: TrainParams, store: HiddenStore) -> Plan:
    lengths = np.minimum(store.num_tokens, params.max_seq_len)
    heldout = np.array([is_heldout(s, params.eval_fraction) for s in store.sample_ids], dtype=bool)
    # One anchor needs two tokens; a sample without generated tokens teaches nothing at prompt weight 0.
    useful = (lengths >= 2) & ((store.num_loss_tokens > 0) | (params.prompt_loss_weight > 0))
    if idle := int(((lengths >= 2) & ~useful).sum()):
        print(f"train: {idle} samples without generated tokens (conversations with dataset answers) are skipped: "
              "train.prompt_loss_weight=0 weighs their every position 0", file=sys.stderr)
    train_rows = np.flatnonzero(useful & ~heldout)
    heldout_rows = sorted(np.flatnonzero(useful & heldout), key=lambda r: -lengths[r])
    epochs = [
        epoch_steps(
            train_rows,
            lengths,
            seed=params.seed,
            epoch=epoch,
            max_tokens=params.max_tokens_per_batch,
            length_group=params.length_group,
            batches_per_step=params.batches_per_step,
        )
        for epoch in range(params.epochs)
    ]
    if not all(epochs):
        raise TrainError(
            f"{len(train_rows)} training samples fill fewer than batches_per_step={params.batches_per_step} "
            "batches: not one optimizer step"
        )
    return Plan(epochs, pack(heldout_rows, lengths, params.max_tokens_per_batch), lengths, len(train_rows),
                len(heldout_rows))


def distribution_weights(loss_mask: Tensor, length: int, prompt_loss_weight: float) -> Tensor:
    """Loss weight [length] of the target's distribution at each position p of a sample cut to
    `length` tokens: 1 where the token it predicts (p+1) was generated, prompt_loss_weight
    elsewhere. Past the stored tokens the predicted token is unknown and counts as not
    generated; a sample cut shorter than stored still sees its real next token's mask."""
    generated = torch.zeros(length, dtype=torch.bool)
    following = loss_mask[1 : length + 1].bool()
    generated[: len(following)] = following
    return torch.where(generated, 1.0, float(prompt_loss_weight))


@dataclass
class Batch:
    aux: Tensor  # [B, L, n*Ht] the target's aux states at anchors t = 0..L-1
    next_ids: Tensor  # [B, L+K-1] int64: column j holds token j+1
    next_last: Tensor  # [B, L+K-1, Ht] the target's `last` state at position j+1
    next_weight: Tensor  # [B, L+K-1] fp32 loss weight of the distribution at j+1; 0 past the sample
    tokens: int  # real (unpadded) tokens

    @property
    def anchors(self) -> int:
        return self.aux.shape[1]

    def step(self, k: int) -> tuple[Tensor, Tensor, Tensor]:
        """What TTT step k reads at anchors t = 0..L-1: token ids t+1+k [B, L], the target's
        last states at t+1+k [B, L, Ht] and their loss weights [B, L]."""
        cols = slice(k, k + self.anchors)
        return self.next_ids[:, cols], self.next_last[:, cols], self.next_weight[:, cols]

    def step_weights(self, steps: int) -> Tensor:
        """[steps] total loss weight of each TTT step."""
        return torch.stack([self.step(k)[2].sum() for k in range(steps)])


@dataclass
class StoredBatch:
    """A Batch as the loader hands it over: the bf16 states still as the store keeps them
    (StatePlanes or Fp8States, [B, columns, ...]), which to() moves and decodes on the device.
    Decoding there spares the loader's CPU threads most of their work (the planes' transpose, the
    float8 decode) and moves fewer bytes (float8: half)."""

    aux: StoredStates
    next_ids: Tensor
    next_last: StoredStates
    next_weight: Tensor
    tokens: int

    def to(self, device: torch.device, dtype: torch.dtype) -> Batch:
        """The Batch on `device`, states in the compute dtype (copied asynchronously from pinned memory)."""
        return Batch(self.aux.to(device).decode().to(dtype), self.next_ids.to(device, non_blocking=True),
                     self.next_last.to(device).decode().to(dtype), self.next_weight.to(device, non_blocking=True),
                     self.tokens)


def collate(
    samples: Sequence[dict[str, Tensor | StoredStates]],
    *,
    ttt_steps: int,
    max_seq_len: int,
    prompt_loss_weight: float,
    pin_memory: bool = False,
) -> StoredBatch:
    """Right-padded batch of samples as the store reads them as_stored (input_ids, loss_mask, and
    aux and last as StatePlanes or Fp8States), each cut to max_seq_len tokens; every sample needs
    at least 2 tokens (one anchor). Padding decodes to bf16 zeros. pin_memory: the batch is
    assembled in page-locked memory, from which the GPU copies it without another pass."""
    lengths = [min(len(s["input_ids"]), max_seq_len) for s in samples]
    anchors = max(lengths) - 1
    width = anchors + ttt_steps - 1
    rows = len(samples)
    aux = samples[0]["aux"].batch(rows, anchors, pin_memory)
    next_last = samples[0]["last"].batch(rows, width, pin_memory)
    next_ids = torch.empty(rows, width, dtype=torch.int64, pin_memory=pin_memory)
    next_weight = torch.empty(rows, width, dtype=torch.float32, pin_memory=pin_memory)
    for i, (sample, n) in enumerate(zip(samples, lengths)):
        aux.put_row(i, sample["aux"], 0, n - 1)
        next_last.put_row(i, sample["last"], 1, n - 1)
        next_ids[i, : n - 1] = sample["input_ids"][1:n].long()
        next_weight[i, : n - 1] = distribution_weights(sample["loss_mask"], n, prompt_loss_weight)[1:]
        next_ids[i, n - 1 :].zero_()  # padding only: zeroing whole buffers first would write every byte twice
        next_weight[i, n - 1 :].zero_()
    return StoredBatch(aux, next_ids, next_last, next_weight, tokens=sum(lengths))


def batch_loader(
    store: HiddenStore,
    batches: list[list[int]],
    *,
    ttt_steps: int,
    max_seq_len: int,
    prompt_loss_weight: float,
    num_workers: int,
    pin_memory: bool,
) -> Generator[StoredBatch, None, None]:
    """The batches in order, each read, checked, decoded and collated by one of `num_workers`
    threads ahead of the training loop (0: in the caller). Threads, not processes: reading,
    CRC, zstd and tensor copies release the GIL, and a thread can collate straight into pinned
    memory that the GPU copies from, where a worker process hands its batch over through shared
    memory that the main process must copy once more (on an H200 host that copy capped the
    reader near the trainer's need). close() stops it, dropping batches not yet started."""

    def read(rows: list[int]) -> StoredBatch:
        samples = [to_torch(store.read_row(row, as_stored=True)) for row in rows]
        return collate(samples, ttt_steps=ttt_steps, max_seq_len=max_seq_len, prompt_loss_weight=prompt_loss_weight,
                       pin_memory=pin_memory)

    if num_workers == 0:
        yield from map(read, batches)
        return
    pool = ThreadPoolExecutor(num_workers, thread_name_prefix="batch-reader")
    try:
        todo = iter(batches)
        # every thread busy and two batches ready: at 16K-token batches of an 8B target each is 0.5 GB
        ahead = collections.deque(pool.submit(read, rows) for rows in itertools.islice(todo, num_workers + 2))
        while ahead:
            batch = ahead.popleft().result()
            for rows in itertools.islice(todo, 1):
                ahead.append(pool.submit(read, rows))
            yield batch
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
