"""Efficiencies of the planner's stage models, from measured runs on any machine.

Sources: a stage metrics directory of a pipeline run (metrics/*.json; the run's params.yaml beside it
supplies what the metrics do not record: generate.concurrency, target.dtype, train.ttt_steps) and
benchmark records (benchmarks/results/*.json from extract_bench.py, train_bench.py, storage_cpu.py).
Each measurement names the hardware and target profile it ran on, matched by what the record says
about the machine (GPU model and count, CPU cores) and the model geometry. Efficiency = the model's
seconds at peak on that machine / the measured seconds.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from eagle3.params import read_params
from tools.planner import model
from tools.planner.profiles import PLANNER_DIR, DrafterGeometry, Hardware, Target, available, load_hardware, load_target

DTYPE_WEIGHTS = {"float32": "fp32", "bfloat16": "bf16", "float16": "bf16"}  # 16-bit weights read the same bytes


class CalibrationError(ValueError):
    pass


@dataclass(frozen=True)
class Measurement:
    stage: str  # generate | extract (the HF path) | extract-vllm (through the serving engine) | train
    source: str
    hardware: Hardware
    target: str
    roofline_s: float
    measured_s: float

    @property
    def efficiency(self) -> float:
        return self.roofline_s / self.measured_s


@dataclass
class Calibration:
    measurements: list[Measurement] = field(default_factory=list)
    # extract.store_dtype -> measured stored/raw ratios of the hidden store
    stored_over_raw: dict[str, list[tuple[float, str]]] = field(default_factory=lambda: {"bf16": [], "fp8_e4m3": []})
    compress_mb_s_per_core: list[tuple[float, str]] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)  # sources that measured nothing usable, and why

    def pick(self, stage: str, on_gpu: bool) -> Measurement:
        """The first measurement of `stage` on the same kind of device (GPU or CPU), else of the other kind."""
        found = [m for m in self.measurements if m.stage == stage]
        if not found:
            raise CalibrationError(f"no measurement calibrates '{stage}' (unused sources: {'; '.join(self.unused) or 'none'})")
        same_kind = [m for m in found if (m.hardware.gpu_count > 0) == on_gpu]
        return (same_kind or found)[0]


# ------------------------------------------------------------------------------- matching profiles


def match_hardware(machine: dict[str, Any], source: str, root: Path) -> Hardware:
    for name in available("hardware", root):
        hw = load_hardware(name, root)
        if hw.gpu_count != (machine.get("gpu_count") or 0):
            continue
        if (hw.gpu_count and hw.gpu_model == machine.get("gpu_model")) or (
                not hw.gpu_count and hw.cpu_cores == machine.get("cpu_cores")):
            return hw
    raise CalibrationError(f"{source}: no hardware profile in {root / 'hardware'} matches the machine {machine} "
                           f"(add one; available: {', '.join(available('hardware', root))})")


def match_target(hidden: int, vocab: int, layers: int | None, source: str, root: Path) -> Target:
    for name in available("targets", root):
        target = load_target(name, root)
        if (target.hidden_size, target.vocab_size) == (hidden, vocab) and layers in (None, target.layers):
            return target
    raise CalibrationError(f"{source}: no target profile in {root / 'targets'} has hidden {hidden}, vocab {vocab}, "
                           f"layers {layers} (available: {', '.join(available('targets', root))})")


# ------------------------------------------------------------------------------------- the sources


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CalibrationError(f"{path}: {err}") from err


def key(record: dict[str, Any], name: str, source: Path) -> Any:
    if name not in record:
        raise CalibrationError(f"{source}: missing key '{name}'")
    return record[name]


def param(params: dict[str, Any], section: str, name: str, source: Path) -> Any:
    try:
        return params[section][name]
    except (KeyError, TypeError):
        raise CalibrationError(f"{source}: missing {section}.{name}") from None


def from_metrics_dir(directory: Path, cal: Calibration, root: Path) -> None:
    """The generate, extract and train metrics of one pipeline run."""
    target_path = directory / "target.json"
    if not target_path.is_file():
        cal.unused.append(f"{directory}: no target.json (the run's model)")
        return
    t = read_json(target_path)
    target = match_target(key(t, "hidden_size", target_path), key(t, "vocab_size", target_path),
                          key(t, "num_layers", target_path), str(target_path), root)
    params_path = directory.parent / "params.yaml"
    params = read_params(params_path)
    weights = DTYPE_WEIGHTS[param(params, "target", "dtype", params_path)]
    for stage, reader in (("generate", generate_measurement), ("extract", extract_measurement),
                          ("train", train_measurement)):
        path = directory / f"{stage}.json"
        if not path.is_file():
            cal.unused.append(f"{path}: not found (stage not run)")
            continue
        record = read_json(path)
        hw = match_hardware(key(record, "machine", path), str(path), root)
        reader(record, path, hw, target, weights, params, params_path, cal)


def generate_measurement(m: dict, path: Path, hw: Hardware, target: Target, weights: str, params: dict,
                         params_path: Path, cal: Calibration) -> None:
    responses = key(m, "responses", path)
    if not responses or not key(m, "new_generated_tokens", path):
        cal.unused.append(f"{path}: a resumed run that generated nothing new")
        return
    work = model.Workload(samples=responses, prompt_tokens=key(m, "prompt_tokens", path) / responses,
                          completion_tokens=key(m, "generated_tokens", path) / responses,
                          concurrency=param(params, "generate", "concurrency", params_path), weights=weights)
    cal.measurements.append(Measurement("generate", str(path), hw, target.name,
                                        model.generation_roofline_s(target, hw, work), key(m, "wall_s", path)))


def extract_measurement(m: dict, path: Path, hw: Hardware, target: Target, weights: str, params: dict,
                        params_path: Path, cal: Calibration) -> None:
    store_dtype = m.get("store_dtype", "bf16")  # runs before extract.store_dtype stored bf16
    if store_dtype not in (None, *cal.stored_over_raw):
        raise CalibrationError(f"{path}: store_dtype {store_dtype!r}, expected one of {sorted(cal.stored_over_raw)}")
    if store_dtype is not None:  # None: a token store (train.source online/hybrid), no states to measure
        cal.stored_over_raw[store_dtype].append((key(m, "stored_over_raw", path), str(path)))
    new = key(m, "new_tokens", path)
    if not new:
        cal.unused.append(f"{path}: a resumed run that extracted nothing new (new_tokens 0); "
                          f"`dvc repro -f extract` measures it")
        return
    seq = key(m, "tokens", path) / key(m, "items", path)
    engine = m.get("engine", "hf")  # runs before extract.engine existed took the HF path
    roofline = (model.engine_extraction_roofline_s if engine == "vllm" else model.extraction_roofline_s)
    cal.measurements.append(Measurement("extract-vllm" if engine == "vllm" else "extract", str(path), hw, target.name,
                                        roofline(target, hw, new, seq, weights),
                                        new / key(m, "new_tokens_per_s", path)))


def train_measurement(m: dict, path: Path, hw: Hardware, target: Target, weights: str, params: dict,
                      params_path: Path, cal: Calibration) -> None:
    tokens, rate = key(m, "tokens", path), key(m, "train_tokens_per_s", path)
    if not tokens or not rate:
        cal.unused.append(f"{path}: a resumed run that trained nothing new")
        return
    drafted = replace(target, drafter=replace(target.drafter, draft_vocab=key(m, "draft_vocab_size", path)))
    seq = key(m, "total_tokens", path) / key(m, "total_samples", path)
    compute, comm = model.training_roofline_s(drafted, hw, tokens, seq, param(params, "train", "ttt_steps", params_path),
                                              param(params, "train", "max_tokens_per_batch", params_path))
    cal.measurements.append(Measurement("train", str(path), hw, target.name, compute + comm, tokens / rate))


def from_benchmark(path: Path, record: dict[str, Any], cal: Calibration, root: Path) -> None:
    """A benchmark record, recognised by its keys; records of other benchmarks are not calibrations."""
    if "forward_only_tokens_per_s" in record:  # benchmarks/extract_bench.py
        g = key(record, "geometry", path)
        target = match_target(g["hidden_size"], g["vocab_size"], g["num_hidden_layers"], str(path), root)
        hw = match_hardware(key(record, "device", path), str(path), root)
        tokens = key(record, "batch", path) * key(record, "seq", path)
        cal.measurements.append(Measurement(
            "extract", str(path), hw, target.name,
            model.extraction_roofline_s(target, hw, tokens, key(record, "seq", path), "bf16"),
            tokens / key(record, "ours_tokens_per_s", path)))
        # random weights' states: the ratio of a store_dtype, not of real states (docs/benchmarks.md)
        cal.stored_over_raw[record.get("store_dtype", "bf16")].append((key(record, "ours_stored_over_raw", path),
                                                                        str(path)))
    elif "engine_tokens_per_s" in record:  # benchmarks/extract_engines.py: both paths on one store
        g = key(record, "geometry", path)
        target = match_target(g["hidden_size"], g["vocab_size"], g["num_layers"], str(path), root)
        hw = match_hardware(key(record, "machine", path), str(path), root)
        tokens, seq = key(record, "tokens", path), key(record, "mean_seq", path)
        weights = DTYPE_WEIGHTS[key(record, "dtype", path)]
        for stage, roofline, rate in (("extract", model.extraction_roofline_s, "hf_tokens_per_s"),
                                      ("extract-vllm", model.engine_extraction_roofline_s, "engine_tokens_per_s")):
            cal.measurements.append(Measurement(stage, str(path), hw, target.name,
                                                roofline(target, hw, tokens, seq, weights),
                                                tokens / key(record, rate, path)))
    elif "model_gflops_per_step" in record:  # benchmarks/train_bench.py
        g = key(record, "geometry", path)
        target = match_target(g["hidden"], g["vocab"], None, str(path), root)
        hw = match_hardware(key(record, "device", path), str(path), root)
        drafter = DrafterGeometry(hidden_size=g["hidden"], intermediate_size=g["intermediate"], heads=g["heads"],
                                  kv_heads=g["kv_heads"], head_dim=g["hidden"] // g["heads"],
                                  draft_vocab=g["draft_vocab"])
        compute, _ = model.training_roofline_s(replace(target, drafter=drafter), hw, g["seq"], g["seq"],
                                               g["ttt_steps"], g["seq"])
        cal.measurements.append(Measurement("train", str(path), hw, target.name, compute,
                                            g["seq"] / key(record, "ours_tokens_per_s", path)))
    elif "compress_mb_s_per_core" in record:  # benchmarks/storage_cpu.py
        cal.compress_mb_s_per_core.append((record["compress_mb_s_per_core"], str(path)))


def calibrate(sources: list[Path], root: Path = PLANNER_DIR) -> Calibration:
    """Measurements from metrics directories and benchmark files (a directory of *.json benchmark records
    without target.json is read as benchmarks), in the order given."""
    cal = Calibration()
    for source in sources:
        if source.is_dir() and (source / "target.json").is_file():
            from_metrics_dir(source, cal, root)
        elif source.is_dir():
            for path in sorted(source.glob("*.json")):
                from_benchmark(path, read_json(path), cal, root)
        elif source.is_file():
            from_benchmark(source, read_json(source), cal, root)
        else:
            raise CalibrationError(f"{source}: no such file or directory")
    return cal
