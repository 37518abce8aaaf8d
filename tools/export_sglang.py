"""Export the drafter for SGLang: the same weights, a config.json whose aux layer ids SGLang reads right
(eagle3/model/sglang.py says why they differ from vLLM's).

    python -m tools.export_sglang [--drafter artifacts/drafter] [--out artifacts/drafter-sglang]
                                  [--target artifacts/target]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eagle3.model.sglang import DRAFTER_DIR, EXPORT_KEY, OUT_DIR, TARGET_DIR, ExportError, export


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", type=Path, default=DRAFTER_DIR)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--target", type=Path, default=TARGET_DIR, help="target model dir with an HF config.json")
    args = parser.parse_args(argv)
    try:
        cfg = export(args.drafter, args.out, args.target)
    except ExportError as err:
        print(f"export_sglang: {err}", file=sys.stderr)
        return 1
    record = cfg[EXPORT_KEY]
    print(f"export_sglang: {args.out} (aux ids {record['vllm_aux_layer_ids']} in vLLM's convention -> "
          f"{cfg['eagle_config']['eagle_aux_hidden_state_layer_ids']} in SGLang's, rule {record['sglang_id_rule']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
