"""The drafter's vocabulary: the N target tokens the target generates most often, as d2t/t2d.

Ranks by generated tokens: prompt tokens are never drafted. Ties, and the ids left over when
fewer distinct tokens were generated than the vocabulary holds (small runs, 32K vocabularies),
go to the tokens of the rest of the training text (prompts, dataset answers), the most frequent
first: those are words the target may well answer with, unlike the lowest ids. The map is in
the form vLLM and SGLang read: `d2t[i]` = target id of draft id i minus i (int64 offsets) and
`t2d` = which target ids are in the draft vocabulary (bool). Fine-tuning keeps an existing
drafter's map instead (`from_drafter`): the rows of its lm_head belong to that map.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from eagle3.atomic import atomic_dir, atomic_write_json
from eagle3.errors import PipelineError

RESPONSES = Path("artifacts/responses/responses.parquet")
ANSWERED = Path("artifacts/prompts/answered.parquet")  # conversations trained on with their dataset answers
VOCAB_DIR = Path("artifacts/vocab")


class VocabError(PipelineError, ValueError):
    pass


@dataclass
class VocabParams:
    draft_vocab_size: int  # 32000 for big targets
    from_drafter: str | None  # a served drafter directory whose d2t/t2d to keep


def count_tokens(path: Path, column: str, vocab_size: int) -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for batch in pq.ParquetFile(path).iter_batches(columns=[column]):
        ids = batch.column(0).flatten().to_numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise VocabError(f"{path}: {column} has token id {bad} outside the target vocabulary ({vocab_size})")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def top_n_map(counts: np.ndarray, n: int, context: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Most frequent in `counts` first, ties by `context` counts, then by lower id; unseen ids fill up
    to n so the size is exactly n."""
    context = np.zeros_like(counts) if context is None else context
    order = np.lexsort((np.arange(counts.size), -context, -counts))
    draft_ids = np.sort(order[:n])
    t2d = np.zeros(counts.size, dtype=bool)
    t2d[draft_ids] = True
    return (draft_ids - np.arange(n)).astype(np.int64), t2d


def drafter_map(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    from safetensors.numpy import load_file

    tensors = load_file(folder / "model.safetensors")
    if "d2t" not in tensors or "t2d" not in tensors:
        raise VocabError(f"vocab.from_drafter={folder}: model.safetensors has no d2t/t2d vocab map")
    return tensors["d2t"].astype(np.int64), tensors["t2d"].astype(bool)


def build(params: VocabParams, vocab_size: int, responses: Path = RESPONSES, out: Path = VOCAB_DIR,
          answered: Path | None = ANSWERED) -> dict[str, Any]:
    if not 0 < params.draft_vocab_size <= vocab_size:
        raise VocabError(f"vocab.draft_vocab_size={params.draft_vocab_size}: expected 1..{vocab_size} "
                         "(the target's vocabulary size)")
    counts = count_tokens(responses, "completion_token_ids", vocab_size)
    filled = 0
    if params.from_drafter:
        d2t, t2d = drafter_map(Path(params.from_drafter))
        if t2d.size != vocab_size:
            raise VocabError(f"vocab.from_drafter={params.from_drafter}: t2d has {t2d.size} entries, "
                             f"the target's vocabulary {vocab_size}")
    else:
        context = count_tokens(responses, "prompt_token_ids", vocab_size)
        if answered is not None:  # written by the prompts stage, empty without dataset answers
            context += count_tokens(answered, "token_ids", vocab_size)
        d2t, t2d = top_n_map(counts, params.draft_vocab_size, context)
        filled = int((t2d & (counts == 0) & (context > 0)).sum())
    total = int(counts.sum())
    stats = {"draft_vocab_size": int(d2t.size), "target_vocab_size": vocab_size,
             "generated_tokens": total, "distinct_generated": int((counts > 0).sum()),
             "filled_from_context": filled,
             "coverage": round(float(counts[t2d].sum()) / total, 6) if total else 0.0,
             "source": params.from_drafter or "top_n"}
    with atomic_dir(out) as tmp:
        np.save(tmp / "d2t.npy", d2t)
        np.save(tmp / "t2d.npy", t2d)
        atomic_write_json(tmp / "stats.json", stats)
    return stats
