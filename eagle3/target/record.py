"""The target's record (artifacts/target/target.json): what every later stage knows of the target.

Written by the target stage (eagle3/target/build.py): architecture, geometry, dtype, where the
weights are and a hash of them, the default aux layer ids in vLLM's convention.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from eagle3.errors import PipelineError

TARGET_DIR = Path("artifacts/target")
RECORD = "target.json"


class TargetError(PipelineError, ValueError):
    pass


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default: low, middle and high layer (id X = output of decoder layer X-1)."""
    return [2, num_layers // 2, num_layers - 3]


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    # Multimodal wrappers (Kimi-K2.5) keep the language model's geometry under text_config.
    return config.get("text_config") or config


def hub_kwargs(record: dict[str, Any]) -> dict[str, Any]:
    """What every from_pretrained of the target passes: the commit the target stage pinned (hub targets;
    None elsewhere) and the user's consent to the repo's own code (target.trust_remote_code: without it, a
    tokenizer class transformers does not ship fails to load or falls back to a generic one)."""
    return {"revision": record.get("revision"), "trust_remote_code": bool(record.get("trust_remote_code"))}


def load_tokenizer(folder: Path = TARGET_DIR) -> Any:
    """The target's tokenizer and chat template from the target stage's folder, as the stage checked them."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=hub_kwargs(load_record(folder))["trust_remote_code"])


def sha256_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def load_record(folder: Path = TARGET_DIR) -> dict[str, Any]:
    path = folder / RECORD
    if not path.is_file():
        raise TargetError(f"{path}: missing; run the target stage first (dvc repro target)")
    return json.loads(path.read_text())
