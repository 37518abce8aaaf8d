"""Stage `evaluate`: acceptance of the drafter offline (our decoder) and in the real engine (vLLM).

Questions are drawn evenly by category from each set of `evaluate.sets`. Offline, the target runs
through transformers and our chain speculative decoder counts what a round accepts, with the aux ids
and vocabulary map the drafter was TRAINED with, drafting as vLLM drafts (greedily); in vLLM, the
target is served with the exported drafter (`--speculative-config eagle3`) and each response carries
its acceptance counts (checked against /metrics) and tokens. At T=0 and on the long answers our
decoder counts along vLLM's own answers (the same text: within `evaluate.replay_tolerance`; with
`online: false`, along the target's greedy answers through transformers); at T > 0 it samples its own
answers on a subset (within `evaluate.agreement_tolerance` of vLLM on those questions). And the
export's aux ids and d2t must equal the training record's, else the stage fails before anyone deploys
the drafter. Writes metrics/evaluate.json and the plots.
"""
from __future__ import annotations

import sys
import time

from eagle3.cli import run_stage
from eagle3.engine.state import require_accelerators_free
from eagle3.engine.vllm_cpu_fixes import status as sampling_fix_status
from eagle3.evaluation.acceptance import export_mismatches
from eagle3.evaluation.offline import OfflineEvaluator
from eagle3.evaluation.online import online_eval
from eagle3.evaluation.params import EvalPaths, EvaluateParams
from eagle3.evaluation.questions import first_of_each_set, questions
from eagle3.evaluation.results import evaluation_metrics, pick, summary_lines, write_plots
from eagle3.metrics import write_metrics
from eagle3.params import load_section
from eagle3.target.record import load_record, load_tokenizer


def main() -> None:
    start = time.monotonic()
    require_accelerators_free("evaluate")
    params = load_section("evaluate", EvaluateParams)
    paths = EvalPaths()
    record = load_record(paths.target)
    tokenizer = load_tokenizer(paths.target)
    items = questions(params, paths.prompts)
    greedy = (list(range(len(items))) if params.offline_greedy_questions is None
              else first_of_each_set(items, params.offline_greedy_questions))
    offline_indices = {t: greedy if t == 0 else first_of_each_set(items, params.offline_sampling_questions)
                       for t in params.temperatures}
    long_items = [item for item in items if item["set"] == items[0]["set"]][: params.long_answer_questions]
    # vLLM first: at T=0 our decoder counts along the engine's own answers (the same text; results.py)
    online = online_eval(params, record, items, long_items) if params.online else None
    offline = None
    if params.offline:
        evaluator = OfflineEvaluator(params, record, tokenizer, paths)
        offline = {t: (evaluator.replay_answers(pick(online[t].tokens, offline_indices[t]), "vLLM's T=0 answers")
                       if t == 0 and online else
                       evaluator.run(pick(items, offline_indices[t]), t, params.max_new_tokens))[0]
                   for t in params.temperatures}
        if long_items:
            offline["long"] = (evaluator.replay_answers(online["long"].tokens, "vLLM's long answers",
                                                        params.max_new_tokens) if online else
                               evaluator.run(long_items, 0.0, params.long_max_new_tokens, params.max_new_tokens))
        offline["draft_vocab_coverage"] = round(evaluator.draft_vocab_coverage(), 4)
    metrics, failures = evaluation_metrics(params, items, offline, online, offline_indices, long_items,
                                           sampling_fix_status())
    mismatches = export_mismatches(paths)
    metrics["export_matches_training"] = not mismatches
    wall = time.monotonic() - start
    generated = sum(s.generated for t in params.temperatures for s in offline[t]) if offline else 0
    write_metrics("evaluate", wall, items=len(items), tokens=generated, **metrics)
    write_plots(metrics)
    print("\n".join(summary_lines(metrics)))
    print(f"evaluate: {len(items)} questions, the draft vocabulary holds {metrics['offline_draft_vocab_coverage']} of "
          f"the target's answer tokens, {wall:.0f}s")
    if failures or mismatches:
        sys.exit("\n".join(f"evaluate: {problem}" for problem in [*mismatches, *failures]))


if __name__ == "__main__":
    run_stage("evaluate", __doc__, main)
