"""The offline evaluator's two ways to count acceptance at T=0, at Llama-3.1-8B geometry.

The evaluate stage used to count along the target's own greedy answers, generated through
transformers (`greedy_answers`, batched, the aux states kept from generation, then `SpecDecoder.replay`);
now it counts along the engine's answers (`replay_along`: one target forward per answer, then the same
replay). This times both on the same answers: a random-weights target at Llama-3.1-8B geometry (bf16,
on the GPU if there is one) and a random drafter (3 aux layers, 32,000 draft ids), --prompts prompts of
--prompt-tokens random ids answered to --new-tokens tokens (no end-of-turn: random weights never stop).
Both paths must count the same rounds and accepts on those answers (the aux states of generation and
of one forward agree); the script says whether they did. Random weights: the time of each forward is
the real one, the acceptance is not.

  python benchmarks/offline_eval_bench.py --out benchmarks/results/offline-eval-h200.json
  python benchmarks/offline_eval_bench.py --geometry tiny --prompts 4 --new-tokens 16   (CPU smoke run)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere
from benchmarks.online_bench import GEOMETRIES  # noqa: E402
from eagle3.evaluation.acceptance import pooled  # noqa: E402
from eagle3.evaluation.offline import greedy_answers, replay_along, replay_counts  # noqa: E402
from eagle3.evaluation.speculative import SpecDecoder  # noqa: E402
from eagle3.metrics import machine_info  # noqa: E402
from eagle3.model.checkpoint import LoadedDrafter  # noqa: E402
from eagle3.model.drafter import Drafter, DrafterConfig  # noqa: E402
from eagle3.progress import Progress  # noqa: E402


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", choices=GEOMETRIES, default="llama-3.1-8b")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per generate call (evaluate.offline_batch_size)")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    geometry = GEOMETRIES[args.geometry]
    config = LlamaConfig(**{k: v for k, v in geometry.items() if k != "draft_vocab"}, max_position_embeddings=8192,
                         rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        target = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    layers = config.num_hidden_layers
    aux_ids = [2, layers // 2, layers - 3] if layers >= 8 else [0, 1, 2]  # low, middle, high, as EAGLE-3 picks
    draft_ids = torch.randperm(config.vocab_size)[: geometry["draft_vocab"]].sort().values
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    drafter = LoadedDrafter(Drafter(DrafterConfig.from_target(config, draft_vocab_size=draft_ids.numel(),
                                                              aux_layer_ids=aux_ids)).eval(),
                            draft_ids - torch.arange(draft_ids.numel()), t2d)
    decoder = SpecDecoder(target, drafter, aux_ids, args.k, temperature=0.0)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (args.prompt_tokens,), generator=generator).tolist()
               for _ in range(args.prompts)]

    synchronize()
    start = time.monotonic()
    answers = greedy_answers(target, prompts, args.new_tokens, set(), 0, args.batch_size,
                             Progress("own answers: generate", len(prompts), "answers"), decoder.capture)
    synchronize()
    generate_s = time.monotonic() - start
    own = [replay_counts(decoder, prompt, answer.tokens, answer.aux, None)[0] for prompt, answer in zip(prompts, answers)]
    synchronize()
    own_s = time.monotonic() - start
    engine_answers = [[(prompt, answer.tokens)] for prompt, answer in zip(prompts, answers)]
    del answers  # the aux states kept from generation go before the second path
    synchronize()
    start = time.monotonic()
    along, _ = replay_along(decoder, engine_answers, Progress("along given answers", len(prompts), "answers"))
    synchronize()
    along_s = time.monotonic() - start
    own_total, along_total = pooled(own), pooled(along)
    result = {"benchmark": "offline-eval", "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": machine_info(), "geometry": args.geometry, "prompts": args.prompts,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "batch_size": args.batch_size,
              "k": args.k,
              "own_answers_s": round(own_s, 2), "of_which_generate_s": round(generate_s, 2),
              "along_given_answers_s": round(along_s, 2), "speedup": round(own_s / along_s, 2),
              "same_counts": (own_total.rounds, own_total.accepted_per_pos)
              == (along_total.rounds, along_total.accepted_per_pos),
              "rounds": [own_total.rounds, along_total.rounds],
              "accepted_per_pos": [own_total.accepted_per_pos, along_total.accepted_per_pos]}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
