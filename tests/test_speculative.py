"""Offline speculative decoding: exact at temperature 0, distribution-preserving at T > 0."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from eagle3.evaluation.speculative import SpecDecoder
from eagle3.model.checkpoint import LoadedDrafter
from eagle3.model.drafter import Drafter, DrafterConfig
from eagle3.target.chat import render


def random_drafter(target_config, aux_ids, draft_ids: torch.Tensor, seed: int = 0) -> LoadedDrafter:
    torch.manual_seed(seed)
    config = DrafterConfig.from_target(target_config, draft_vocab_size=draft_ids.numel(), aux_layer_ids=aux_ids)
    model = Drafter(config).eval()
    t2d = torch.zeros(target_config.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return LoadedDrafter(model, draft_ids - torch.arange(draft_ids.numel()), t2d)


def test_greedy_output_equals_plain_target_decoding(embedded_target, tokenizer):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(embedded_target[0]).eval()
    aux = [2, 15, 27]
    # A draft vocabulary of the first 4096 ids: drafts are often wrong, so rejection paths run too.
    drafter = random_drafter(target.config, aux, torch.arange(4096))
    eos = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    for question in ("Write a short poem about autumn leaves.",):
        prompt = render(tokenizer, [{"role": "user", "content": question}], generation_prompt=True)
        with torch.no_grad():
            plain = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt):]
        plain = plain.tolist()
        for k in (1, 3):
            ids, stats = SpecDecoder(target, drafter, aux, k, temperature=0.0).generate(prompt, 40, eos)
            assert ids == plain[: len(ids)] and (len(ids) == 40 or ids[-1] in eos)
            assert stats.rounds > 0 and 1.0 <= stats.acceptance_length() <= k + 1


def test_bf16_target_runs_the_fp32_drafter_in_bf16_as_the_engine_does(embedded_target, tokenizer):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(embedded_target[0], dtype=torch.bfloat16).eval()
    drafter = random_drafter(target.config, [2, 15, 27], torch.arange(4096))
    decoder = SpecDecoder(target, drafter, [2, 15, 27], 3, temperature=0.0)
    assert {p.dtype for p in drafter.model.parameters()} == {torch.bfloat16}
    prompt = render(tokenizer, [{"role": "user", "content": "Name three colours."}], generation_prompt=True)
    ids, stats = decoder.generate(prompt, 16, {tokenizer.convert_tokens_to_ids("<|im_end|>")})
    assert len(ids) == 16 and 1.0 <= stats.acceptance_length() <= 4
    replayed = decoder.replay(prompt, ids, stop=len(ids))
    assert replayed.generated == 16 and 1.0 <= replayed.acceptance_length() <= 4


def test_perfect_drafter_is_always_accepted(embedded_target, tokenizer, monkeypatch):
    """A drafter that proposes the target's own greedy tokens reaches acceptance length k + 1."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(embedded_target[0]).eval()
    prompt = render(tokenizer, [{"role": "user", "content": "Count from one to twenty."}], generation_prompt=True)
    with torch.no_grad():
        plain = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0].tolist()
    decoder = SpecDecoder(target, random_drafter(target.config, [2, 15, 27], torch.arange(49152)), [2, 15, 27], 3, 0.0)

    def oracle(aux, next_tokens, prefix):
        at = len(next_tokens) + 1  # next_tokens = sequence[1:] + [token]: the drafts continue the sequence
        drafts = plain[at: at + 3]
        return drafts, [torch.nn.functional.one_hot(torch.tensor(d), 49152).float() for d in drafts], prefix

    monkeypatch.setattr(decoder, "draft", oracle)
    new = len(plain) - len(prompt) - 4  # the oracle must always have 3 drafts to give
    assert new >= 12
    ids, stats = decoder.generate(prompt, new, eos_ids=set())
    assert ids == plain[len(prompt):len(prompt) + new]
    assert stats.accepted_per_pos == [stats.rounds] * 3 and stats.acceptance_length() == 4.0


def recomputed_drafts(decoder: SpecDecoder, aux: torch.Tensor, next_tokens: list[int]) -> list[int]:
    """Greedy drafts from the TTT unroll over the whole sequence, as training computes it."""
    model, drafts = decoder.drafter.model, []
    embeds = model.embed(torch.tensor([next_tokens]), decoder.embedding)
    step_embeds = []
    for step in range(decoder.k):
        step_embeds.append(embeds)
        heads = model(aux[None], step_embeds, torch.arange(aux.shape[0]))
        drafts.append(int(decoder.draft_to_target[(heads[-1][0, -1] @ model.lm_head.weight.T).argmax()]))
        embeds = embeds.clone()
        embeds[0, -1] = model.embed(torch.tensor([drafts[-1]]), decoder.embedding)
    return drafts


def test_incremental_drafts_equal_the_whole_sequence_unroll(embedded_target, tokenizer):
    """The decoder reuses step-0 keys across rounds; its drafts must be the full unroll's."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(embedded_target[0]).eval()
    drafter = random_drafter(target.config, [2, 15, 27], torch.arange(4096), seed=3)
    decoder = SpecDecoder(target, drafter, [2, 15, 27], 3, temperature=0.0)
    incremental, rounds = decoder.draft, []

    def checked(aux, next_tokens, prefix):
        drafts, qs, keys = incremental(aux, next_tokens, prefix)
        rounds.append((drafts, recomputed_drafts(decoder, aux, next_tokens)))
        return drafts, qs, keys

    decoder.draft = checked
    prompt = render(tokenizer, [{"role": "user", "content": "Name three rivers."}], generation_prompt=True)
    decoder.generate(prompt, 24, eos_ids=set())
    assert len(rounds) >= 6 and all(mine == full for mine, full in rounds), rounds


def test_replay_counts_the_rounds_generate_runs(embedded_target, tokenizer):
    """At T=0 one target forward and one drafter unroll over the greedy continuation give generate()'s
    acceptance exactly."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(embedded_target[0]).eval()
    # A draft vocabulary of frequent ids only, so some drafts are accepted and some are not.
    drafter = random_drafter(target.config, [2, 15, 27], torch.arange(512), seed=5)
    prompt = render(tokenizer, [{"role": "user", "content": "List the days of the week."}], generation_prompt=True)
    with torch.no_grad():
        plain = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                                min_new_tokens=40)[0, len(prompt):].tolist()

    def spoiled(anchor: int) -> int:
        """The draft step an oracle gets wrong from this anchor (k: none): every accept count occurs."""
        return (anchor // 3) % (k + 1)

    def partly_right(aux, next_tokens, prefix):
        """generate's drafter: the true continuation, spoiled at one step."""
        anchor = len(next_tokens) - 1  # next_tokens = sequence[1:] + [token]
        drafts = tokens[anchor + 2 : anchor + 2 + k]
        if spoiled(anchor) < k:
            drafts[spoiled(anchor)] = 0 if drafts[spoiled(anchor)] else 1
        return drafts, [None] * k, prefix

    def partly_right_matches(tokens_, aux):
        """replay's view of the same oracle."""
        return torch.tensor([[j != spoiled(t) for j in range(k)] for t in range(len(tokens_) - 1)])

    tokens = prompt + plain
    for k in (1, 3):
        decoder = SpecDecoder(target, drafter, [2, 15, 27], k, temperature=0.0)
        _, real = decoder.generate(prompt, 30, eos_ids=set())
        replayed = decoder.replay(prompt, plain, stop=30)
        assert (replayed.rounds, replayed.accepted_per_pos) == (real.rounds, real.accepted_per_pos)
        decoder.draft, decoder.draft_matches = partly_right, partly_right_matches
        _, real = decoder.generate(prompt, 30, eos_ids=set())
        replayed = decoder.replay(prompt, plain, stop=30)
        assert (replayed.rounds, replayed.accepted_per_pos) == (real.rounds, real.accepted_per_pos)
        assert sum(real.accepted_per_pos) > 0 and real.accepted_per_pos[0] < real.rounds
        assert k == 1 or 0 < real.accepted_per_pos[-1] < real.accepted_per_pos[0]


def tiny_target(vocab: int = 12, hidden: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper than the random init, so p and q differ visibly
        model.lm_head.weight.mul_(20)
    return model


def test_rejection_sampling_keeps_the_target_distribution():
    """Two tokens sampled speculatively (k=2) follow the target's joint distribution."""
    target = tiny_target()
    drafter = random_drafter(target.config, [1, 2, 3], torch.arange(8), seed=3)  # draft vocab misses 4 ids
    prompt, temperature, runs = [1, 5, 7], 1.0, 3000
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        exact = {}
        for a in range(12):
            p2 = torch.softmax(target(torch.tensor([prompt + [a]])).logits[0, -1] / temperature, -1)
            for b in range(12):
                exact[(a, b)] = float(p1[a] * p2[b])
    decoder = SpecDecoder(target, drafter, [1, 2, 3], k=2, temperature=temperature,
                          generator=torch.Generator().manual_seed(0))
    seen = Counter(tuple(decoder.generate(prompt, 2, eos_ids=set())[0]) for _ in range(runs))
    total_variation = 0.5 * sum(abs(seen[key] / runs - p) for key, p in exact.items())
    # With 144 outcomes and 3000 samples, sampling noise alone gives TV ~ 0.08; a wrong rule gives far more.
    assert total_variation < 0.12, total_variation
    def near_greedy() -> SpecDecoder:
        return SpecDecoder(target, drafter, [1, 2, 3], k=2, temperature=1e-4,
                           generator=torch.Generator().manual_seed(0))
    greedy_drafts_only = Counter(tuple(near_greedy().generate(prompt, 2, set())[0]) for _ in range(3))
    assert len(greedy_drafts_only) == 1  # near-zero temperature: deterministic


def test_sampling_accepts_the_greedy_draft_with_the_targets_probability():
    """The engine's drafting mode at T > 0: the draft is the drafter's argmax, accepted with p(draft).
    So the first round's acceptance is sum_a p(a | prompt) * p(draft(a) | prompt + a), not 0 and not
    the rate of a sampled draft."""
    target = tiny_target()
    drafter = random_drafter(target.config, [1, 2, 3], torch.arange(12), seed=3)
    prompt, runs = [1, 5, 7], 4000
    decoder = SpecDecoder(target, drafter, [1, 2, 3], k=1, temperature=1.0, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1], -1)
        _, aux = decoder.target_forward(prompt, None)
        expected = 0.0
        for a in range(12):
            (draft,), (q,), _ = decoder.draft(aux, prompt[1:] + [a], None)
            assert q[draft] == 1 and q.sum() == 1  # one-hot: no draft probabilities, as in vLLM
            p2 = torch.softmax(target(torch.tensor([prompt + [a]])).logits[0, -1], -1)
            expected += float(p1[a] * p2[draft])
    accepted = sum(decoder.generate(prompt, 2, eos_ids=set())[1].accepted_per_pos[0] for _ in range(runs))
    assert 0.05 < expected < 0.95  # the check can tell a right rule from always/never accepting
    assert abs(accepted / runs - expected) < 4 * (expected * (1 - expected) / runs) ** 0.5 + 0.005


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_decodes_on_the_targets_gpu(tmp_path):
    """On a GPU machine the offline evaluator loads the target there and keeps every tensor there:
    greedy output equals the target's own greedy decoding, the batched greedy answers' captured
    states replay to generate()'s counts, and sampling runs on a GPU generator."""
    from eagle3.evaluation.offline import greedy_answers, load_target
    from eagle3.progress import Progress

    tiny_target(vocab=64, hidden=64).save_pretrained(tmp_path)  # head_dim 16: flex attention's minimum
    target = load_target({"model_path": str(tmp_path), "dtype": "float32"})
    assert target.device.type == "cuda"
    drafter = random_drafter(target.config, [1, 2, 3], torch.arange(48))
    prompts = [[1, 5, 7, 9], [3, 4]]
    decoder = SpecDecoder(target, drafter, [1, 2, 3], k=3, temperature=0.0)
    assert next(drafter.model.parameters()).device.type == "cuda"
    answers = greedy_answers(target, prompts, 20, set(), 0, 2, Progress("t", 2), decoder.capture)
    for prompt, answer in zip(prompts, answers):
        with torch.no_grad():
            plain = target.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=20, do_sample=False,
                                    min_new_tokens=20)[0, len(prompt):].tolist()
        ids, stats = decoder.generate(prompt, 20, eos_ids=set())
        assert ids == plain == answer.tokens
        replayed = decoder.replay(prompt, ids, stop=len(ids), aux=answer.aux)
        assert (replayed.rounds, replayed.accepted_per_pos) == (stats.rounds, stats.accepted_per_pos)
    sampler = SpecDecoder(target, drafter, [1, 2, 3], k=3, temperature=1.0,
                          generator=torch.Generator("cuda").manual_seed(0))
    assert len(sampler.generate(prompts[0], 20, eos_ids=set())[0]) == 20
