"""Stage `evaluate`: acceptance of the drafter offline (our decoder) and in the real engine (vLLM).

Offline, the target answers through transformers and our chain speculative decoder counts what a
round accepts, with the aux ids and vocabulary map the drafter was TRAINED with; in vLLM, the
target is served with the exported drafter (`--speculative-config eagle3`) and acceptance is read
from /metrics. The two must agree within `evaluate.agreement_tolerance`, and the export's aux ids
and d2t must equal the training record's, else the stage fails before anyone deploys the drafter.
Writes metrics/evaluate.json and the per-position and histogram plots.
"""
from __future__ import annotations

import gc
import sys
import time

import torch

from eagle3.cli import run_stage
from eagle3.engine.state import require_accelerators_free
from eagle3.evaluation.acceptance import agreement_failure, export_mismatches, write_plots
from eagle3.evaluation.offline import offline_eval
from eagle3.evaluation.online import online_eval
from eagle3.evaluation.params import EvalPaths, EvaluateParams
from eagle3.evaluation.questions import questions
from eagle3.metrics import write_metrics
from eagle3.params import load_section
from eagle3.target.record import load_record


def main() -> None:
    from transformers import AutoTokenizer

    start = time.monotonic()
    require_accelerators_free("evaluate")
    params = load_section("evaluate", EvaluateParams)
    paths = EvalPaths()
    record = load_record(paths.target)
    tokenizer = AutoTokenizer.from_pretrained(paths.target)
    items = questions(params, paths.prompts)
    offline = offline_eval(params, record, tokenizer, items) if params.offline else None
    if torch.cuda.is_available():  # the offline target's GPU memory back to the driver before vLLM starts
        gc.collect()
        torch.cuda.empty_cache()
    online = online_eval(params, record, items) if params.online else None
    failure = (agreement_failure(offline, online, params.agreement_tolerance)
               if offline and online and params.temperature == 0 else None)
    mismatches = export_mismatches(paths)
    wall = time.monotonic() - start
    metrics = {"num_draft_tokens": params.num_speculative_tokens, "temperature": params.temperature,
               "questions": len(items), "turns": params.turns,
               "offline_acceptance_length": round(offline["acceptance_length"], 4) if offline else None,
               "offline_acceptance_per_position": [round(x, 4) for x in offline["per_position"]] if offline else None,
               "offline_per_category": offline["per_category"] if offline else None,
               "offline_draft_vocab_coverage": round(offline["draft_vocab_coverage"], 4) if offline else None,
               "vllm_acceptance_length": round(online["acceptance_length"], 4) if online else None,
               "vllm_acceptance_per_position": [round(x, 4) for x in online["per_position"]] if online else None,
               "vllm_drafts": online["drafts"] if online else None,
               "throughput_with_drafter": online["throughput_with_drafter"] if online else None,
               "throughput_without_drafter": (online or {}).get("throughput_without_drafter"),
               "agreement": failure is None, "export_matches_training": not mismatches}
    write_metrics("evaluate", wall, items=len(items), tokens=offline["generated"] if offline else 0, **metrics)
    write_plots(params.num_speculative_tokens, offline, online)
    print(f"evaluate: acceptance length at k={params.num_speculative_tokens}, T={params.temperature}: offline "
          f"{metrics['offline_acceptance_length']}, vLLM {metrics['vllm_acceptance_length']} on {len(items)} "
          f"questions; per position offline {metrics['offline_acceptance_per_position']}, vLLM "
          f"{metrics['vllm_acceptance_per_position']}; the draft vocabulary holds "
          f"{metrics['offline_draft_vocab_coverage']} of the target's answer tokens, {wall:.0f}s")
    if failure or mismatches:
        sys.exit("\n".join(f"evaluate: {problem}" for problem in [*mismatches, *([failure] if failure else [])]))


if __name__ == "__main__":
    run_stage("evaluate", __doc__, main)
