"""The planner's machine and target profiles (tools/planner/hardware/*.yaml, tools/planner/targets/*.yaml).

A profile is a YAML mapping whose keys are exactly a dataclass's fields: a missing or unknown key, a
wrong type or an unknown profile name is an error naming the file, the key or the profiles there are.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

PLANNER_DIR = Path("tools/planner")  # holds hardware/ and targets/
T = TypeVar("T")


class ProfileError(ValueError):
    pass


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    gpu_model: str | None  # as nvidia-smi names it; None for a CPU-only machine
    gpu_count: int
    cpu_cores: int
    matmul_tflops: float  # dense, per device (GPU), or for the whole CPU
    memory_tb_s: float  # per device
    memory_gb: float  # per device
    link: str
    link_gb_s: float  # GPU-GPU, per GPU per direction
    price_per_hour: float  # the whole machine

    @property
    def devices(self) -> int:
        """Compute devices: the GPUs, or the CPU as one device."""
        return max(self.gpu_count, 1)


@dataclass(frozen=True)
class Moe:
    experts: int
    experts_per_token: int
    routed_params: float


@dataclass(frozen=True)
class DrafterGeometry:
    hidden_size: int
    intermediate_size: int
    heads: int
    kv_heads: int
    head_dim: int
    draft_vocab: int

    def layer_params(self) -> float:
        """Matmul weights of the decoder layer: q/k/v read 2H inputs, o, and the gated MLP."""
        h, q, kv = self.hidden_size, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    hf_id: str
    total_params: float
    active_params: float
    layers: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    kv_bytes_per_token: int  # at 2 bytes per cached value
    weight_bytes_per_param: dict[str, float]
    default_weights: str
    drafter: DrafterGeometry
    moe: Moe | None = None

    @property
    def body_params(self) -> float:
        """Active parameters that a forward without the lm_head multiplies by (embedding lookups are free)."""
        return self.active_params - self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def weight_bytes(self, weights: str) -> float:
        if weights not in self.weight_bytes_per_param:
            raise ProfileError(f"target {self.name}: no weight format '{weights}' "
                               f"(available: {', '.join(self.weight_bytes_per_param)})")
        return self.total_params * self.weight_bytes_per_param[weights]


def available(kind: str, root: Path = PLANNER_DIR) -> list[str]:
    return sorted(p.stem for p in (root / kind).glob("*.yaml"))


def from_mapping(cls: type[T], raw: Any, source: str, extra: dict[str, Any] | None = None) -> T:
    """A dataclass from a mapping with exactly its fields; nested dataclass fields are built the same way."""
    if not isinstance(raw, dict):
        raise ProfileError(f"{source}: expected a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    given = {**raw, **(extra or {})}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise ProfileError(f"{source}: {unknown[0]}: unknown key (expected: {', '.join(fields)})")
    values = {}
    for name, field in fields.items():
        if name not in given:
            if field.default is dataclasses.MISSING:
                raise ProfileError(f"{source}: {name}: missing key")
            continue
        values[name] = check_type(given[name], field.type, f"{source}: {name}")
    return cls(**values)


NESTED = {"Moe | None": Moe, "DrafterGeometry": DrafterGeometry}


def check_type(value: Any, annotation: str, where: str) -> Any:
    if annotation in NESTED:
        return None if value is None else from_mapping(NESTED[annotation], value, where)
    if annotation == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif annotation == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif annotation == "bool":
        ok = isinstance(value, bool)
    elif annotation == "str":
        ok = isinstance(value, str)
    elif annotation == "str | None":
        ok = value is None or isinstance(value, str)
    elif annotation == "dict[str, float]":
        ok = isinstance(value, dict) and all(isinstance(v, (int, float)) for v in value.values())
    else:
        raise TypeError(f"{where}: no check for type {annotation}")
    if not ok:
        raise ProfileError(f"{where}: expected {annotation}, got {value!r}")
    return value


def load(kind: str, cls: type[T], name: str, root: Path = PLANNER_DIR) -> T:
    path = root / kind / f"{name}.yaml"
    if not path.is_file():
        raise ProfileError(f"no {kind} profile '{name}' in {root / kind} (available: {', '.join(available(kind, root))})")
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    return from_mapping(cls, raw, str(path), extra={"name": name})


def load_hardware(name: str, root: Path = PLANNER_DIR) -> Hardware:
    return load("hardware", Hardware, name, root)


def load_target(name: str, root: Path = PLANNER_DIR) -> Target:
    target = load("targets", Target, name, root)
    if target.default_weights not in target.weight_bytes_per_param:
        raise ProfileError(f"{root / 'targets' / name}.yaml: default_weights: '{target.default_weights}' is not a key "
                           f"of weight_bytes_per_param")
    return target
