"""Where the trainer's states come from (train.source), priced from a plan's own stage estimates.

store:  extract once on every GPU, then train on every GPU; the store on disk.
online: every epoch captures its states again. Split: `c` GPUs capture while the other G - c train,
        the two overlapping (the prefetch buffer hides the capture when it keeps up), so an online
        run takes max(epochs x capture pass on c GPUs, training on G - c GPUs). Shared
        (capture_gpus 0): each GPU does both in turn, epochs x extraction + training. No store.
hybrid: the first epoch as online, the later ones from the store it wrote, on every GPU.
The capture on c GPUs is the extract estimate scaled by G / c (data parallel over replicas; c a
multiple of the GPUs one replica needs), training by G / (G - c): both calibrated as their stages are.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceEstimate:
    source: str
    seconds: float
    disk_bytes: float
    note: str


def splits(devices: int, replica: int) -> list[int]:
    """Capture GPU counts that leave at least one GPU training: multiples of one replica's GPUs."""
    return list(range(replica, devices, replica))


def compare(extract_s: float, train_s: float, epochs: int, devices: int, replica: int, hidden_bytes: float,
            token_bytes: float) -> list[SourceEstimate]:
    """The three sources (online and hybrid at their best split, or shared where none fits), fastest first."""
    per_epoch = train_s / epochs
    out = [SourceEstimate("store", extract_s + train_s, hidden_bytes, "extract once, then train on every GPU")]
    shared_online = epochs * extract_s + train_s
    shared_hybrid = extract_s + train_s
    best_online = (shared_online, "capture shares every GPU (capture_gpus 0)")
    best_hybrid = (shared_hybrid, "first epoch captures on every GPU in turn (capture_gpus 0)")
    for c in splits(devices, replica):
        capture_pass, train_speed = extract_s * devices / c, devices / (devices - c)
        online = max(epochs * capture_pass, train_s * train_speed)
        hybrid = max(capture_pass, per_epoch * train_speed) + (epochs - 1) * per_epoch
        note = f"capture_gpus {c}: {c} capture, {devices - c} train"
        best_online = min(best_online, (online, note))
        best_hybrid = min(best_hybrid, (hybrid, note + ", then all train from the store"))
    out += [SourceEstimate("online", best_online[0], token_bytes, best_online[1]),
            SourceEstimate("hybrid", best_hybrid[0], hidden_bytes, best_hybrid[1])]
    return sorted(out, key=lambda s: s.seconds)
