"""Stage train: alignment, objective, a tiny real run, DDP = one process, kill -9 resume, init_from.

The fixture is a tiny random Llama target (4 layers, hidden 64, vocab 512, tied embeddings)
saved with save_pretrained, and a store written with the store's own writer from a real forward
of it (aux = outputs of layers 0-2, last = output of the last layer before the final norm).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import platform
import signal
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3.model.checkpoint import save_drafter, validate
from eagle3.model.drafter import Drafter, DrafterConfig
from eagle3.store.codec import from_fp8, to_fp8
from eagle3.store.layout import merge_index, write_manifest
from eagle3.store.reader import Fp8States, HiddenStore, StatePlanes
from eagle3.store.writer import ShardWriter
from eagle3.training import state as train_state
from eagle3.training.data import Batch, collate, is_heldout, make_plan
from eagle3.training.loop import train
from eagle3.training.objective import DraftLoss
from eagle3.training.params import Paths, TrainError, TrainParams, check_params
from eagle3.training.teacher import Teacher, load_teacher, target_config
from tests.conftest import shipped

VOCAB, HIDDEN, LAYERS, DRAFT_VOCAB = 512, 64, 4, 128
AUX_IDS = [1, 2, 3]
SAMPLES = 24
INIT_STD = 0.6  # large weights: peaked next-token distributions, something for the drafter to learn
FORK = multiprocessing.get_context("fork")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Bitwise comparisons between processes need the same kernels: one intra-op thread everywhere.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_llama(tied: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        initializer_range=INIT_STD,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # a non-trivial final norm, so forgetting it shows
        model.model.norm.weight.uniform_(0.5, 1.5)
    return model


def write_target(folder: Path, model: LlamaForCausalLM) -> dict:
    """The model as the target stage leaves an embedded target: weights + target.json."""
    model.save_pretrained(folder)
    record = {
        "architecture": "LlamaForCausalLM",
        "num_layers": LAYERS,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 128,
        "default_aux_layer_ids": AUX_IDS,
        "chat_template": True,
        "dtype": "float32",
        "source": str(folder),
        "source_kind": "local",
        "model_path": str(folder),
        "revision": None,
        "parameter_count": sum(p.numel() for p in model.parameters()),
        "weights_hash": "sha256:tiny-test-target",
    }
    (folder / "target.json").write_text(json.dumps(record))
    return record


def capture(model: LlamaForCausalLM, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, 3*H], last [T, H]) the way the extract stage hooks them: vLLM's ids, pre-norm last."""
    layers = model.model.layers
    outputs: dict[int, torch.Tensor] = {}

    def keep(i: int):
        def hook(module, args, out) -> None:
            outputs[i] = out[0] if isinstance(out, tuple) else out
        return hook

    hooks = [layers[i].register_forward_hook(keep(i)) for i in range(LAYERS)]
    with torch.no_grad():
        model(torch.from_numpy(ids).long()[None])
    for hook in hooks:
        hook.remove()
    aux = torch.cat([outputs[i - 1][0] for i in AUX_IDS], dim=-1)
    return aux, outputs[LAYERS - 1][0]


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("train-ws")
    target_dir = root / "artifacts" / "target"
    model = tiny_llama()
    record = write_target(target_dir, model)

    vocab = root / "artifacts" / "vocab"
    vocab.mkdir(parents=True)
    ids = np.arange(0, VOCAB, VOCAB // DRAFT_VOCAB)
    t2d = np.zeros(VOCAB, bool)
    t2d[ids] = True
    np.save(vocab / "d2t.npy", (ids - np.arange(DRAFT_VOCAB)).astype(np.int64))
    np.save(vocab / "t2d.npy", t2d)

    store = root / "artifacts" / "hidden"
    rng = np.random.default_rng(0)
    with ShardWriter(store, shard_samples=8) as writer:
        for i in range(SAMPLES):
            n = int(rng.integers(10, 41))
            tokens = rng.integers(0, VOCAB, n).astype(np.int32)
            mask = (np.arange(n) >= n // 3).astype(np.uint8)  # prompt, then the response
            aux, last = capture(model, tokens)
            writer.put(f"s{i:03d}", {"input_ids": tokens, "loss_mask": mask, "aux": bf16_bits(aux),
                                      "last": bf16_bits(last)})
    totals = merge_index(store)
    write_manifest(store, model_hash=record["weights_hash"], aux_layer_ids=AUX_IDS, layer_id_convention="vLLM",
                   last_state="pre_norm", arrays=writer.stats.schema, level=1, totals=totals)
    return root


def small_params(**overrides) -> TrainParams:
    fields = dict(ttt_steps=3, epochs=4, max_seq_len=48, max_tokens_per_batch=96, batches_per_step=2,
                  length_group=8, lr=1e-2, warmup_steps=2, eval_fraction=0.2, log_every=1,
                  checkpoint_every=3, num_workers=0, ce_chunk_size=64, intermediate_size=None, head_init="target",
                  step_decay=0.8, prompt_loss_weight=0.0, weight_decay=0.0, cpu_bf16=False)
    return shipped("train", TrainParams, **(fields | overrides))


def paths_for(workspace: Path, out: Path) -> Paths:
    artifacts = workspace / "artifacts"
    return Paths(hidden=artifacts / "hidden", vocab=artifacts / "vocab", target=artifacts / "target",
                 out=out / "drafter", run=out / "run", curve=out / "curve.csv", heldout_curve=out / "heldout.csv")


def weights(drafter_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(drafter_dir / "model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.fixture(scope="module")
def trained(workspace, tmp_path_factory) -> tuple[Paths, dict]:
    """One uninterrupted single-process run: the reference of the DDP and resume tests."""
    out = tmp_path_factory.mktemp("reference")
    cwd = os.getcwd()
    os.chdir(out)  # metrics/ lands here
    try:
        record = train(small_params(), paths_for(workspace, out))
    finally:
        os.chdir(cwd)
    return paths_for(workspace, out), record


# ------------------------------------------------------------------------------------ alignment


def stored(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | StatePlanes]:
    """The sample as the train loader reads it from a store: bf16 states as byte planes."""
    return {k: StatePlanes.of(v.to(torch.bfloat16)) if k in ("aux", "last") else v for k, v in sample.items()}


def batch_of(samples: list[dict[str, torch.Tensor]], **params) -> Batch:
    return collate([stored(s) for s in samples], **params).to(torch.device("cpu"), torch.float32)


def hand_sample(mask: list[int]) -> dict[str, torch.Tensor]:
    """5 tokens 10..14; the state at position p is filled with p, so rows show where they came from."""
    positions = torch.arange(5, dtype=torch.float32)[:, None]
    return {
        "input_ids": torch.arange(10, 15, dtype=torch.int32),
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        "aux": positions.expand(5, 3).contiguous(),
        "last": positions.expand(5, 2).contiguous(),
    }


def test_alignment_hand_built():
    w = 0.25  # prompt_loss_weight
    batch = batch_of([hand_sample([0, 0, 1, 1, 0])], ttt_steps=2, max_seq_len=64, prompt_loss_weight=w)
    assert batch.aux[0, :, 0].tolist() == [0, 1, 2, 3]  # anchors t = 0..3 read aux at t
    # step 0 at anchor t: token t+1, target distribution at t+1 (predicts token t+2, whose mask weighs it)
    ids, last, weight = batch.step(0)
    assert ids[0].tolist() == [11, 12, 13, 14]
    assert last[0, :, 0].tolist() == [1, 2, 3, 4]
    assert weight[0].tolist() == [1, 1, w, w]  # tokens 2, 3 generated; token 4 prompt; token 5 unknown
    # step 1 at anchor t: token t+2, distribution at t+2; anchor 3 would need position 5: invalid
    ids, last, weight = batch.step(1)
    assert ids[0, :3].tolist() == [12, 13, 14]
    assert last[0, :3, 0].tolist() == [2, 3, 4]
    assert weight[0].tolist() == [1, w, w, 0]
    assert batch.tokens == 5


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def as_fp8(states: torch.Tensor, group: int) -> tuple[Fp8States, torch.Tensor]:
    """The lossy store's form of bf16 states, and what the host's decode makes of it."""
    words = states.view(torch.int16).numpy().view(np.uint16)
    scales, codes = to_fp8(words, group, "x")
    decoded = torch.from_numpy(from_fp8(scales, codes, words.shape).view(np.int16)).view(torch.bfloat16)
    return Fp8States(torch.from_numpy(codes), torch.from_numpy(scales)), decoded


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["planes", "fp8"])
def test_stored_batch_decodes_the_stored_states_on_the_device(device, form):
    """The loader hands over the states as stored (byte planes, or float8 codes and scales); to() must
    give back exactly the bf16 states the host would decode, shifted and padded with zeros."""
    rng = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.arange(n, dtype=torch.int32), "loss_mask": torch.ones(n, dtype=torch.uint8),
                "aux": torch.randn(n, 6, generator=rng).bfloat16(), "last": torch.randn(n, 2, generator=rng).bfloat16()}
               for n in (7, 4)]
    if form == "planes":
        loaded, want = [stored(s) for s in samples], samples
    else:  # aux: two groups of 3 channels (two layers), last: one
        loaded, want = [], []
        for s in samples:
            (aux, aux_back), (last, last_back) = as_fp8(s["aux"], 3), as_fp8(s["last"], 2)
            loaded.append({**s, "aux": aux, "last": last})
            want.append({"aux": aux_back, "last": last_back})
        assert not torch.equal(want[0]["aux"], samples[0]["aux"])  # lossy: the host's decode is the reference
    batch = collate(loaded, ttt_steps=2, max_seq_len=64, prompt_loss_weight=1.0).to(torch.device(device), torch.bfloat16)
    assert batch.aux.device.type == device and batch.aux.dtype == torch.bfloat16
    assert batch.aux.is_contiguous() and batch.next_last.is_contiguous()  # token-major, as the kernels expect
    for i, (s, w) in enumerate(zip(samples, want)):
        n = len(s["input_ids"])
        assert torch.equal(batch.aux[i, : n - 1].cpu(), w["aux"][: n - 1])
        assert torch.equal(batch.next_last[i, : n - 1].cpu(), w["last"][1:n])
        assert not batch.aux[i, n - 1 :].any() and not batch.next_last[i, n - 1 :].any()


def test_alignment_cut_sample_keeps_its_next_token_mask_and_pads_with_zero_weight():
    sample = hand_sample([0, 0, 1, 1, 1])
    cut = batch_of([sample], ttt_steps=2, max_seq_len=4, prompt_loss_weight=0.0)
    assert cut.step(0)[0][0].tolist() == [11, 12, 13]
    assert cut.step(0)[2][0].tolist() == [1, 1, 1]  # token 4 was cut but generated
    both = batch_of([sample, {k: v[:4] for k, v in sample.items()}], ttt_steps=2, max_seq_len=64,
                    prompt_loss_weight=0.5)
    # the 4-token sample: 3 anchors, the last one's predicted token unknown (prompt weight), then padding
    assert both.step(0)[2][1].tolist() == [1, 1, 0.5, 0]
    assert both.step(1)[2][1].tolist() == [1, 0.5, 0, 0]
    assert both.tokens == 9


def reference_losses(drafter: Drafter, teacher: Teacher, sample: dict, steps: int, w: float) -> torch.Tensor:
    """Per-step weighted CE sums of one sample, indexed by hand from the definition."""
    ids, mask = sample["input_ids"].long(), sample["loss_mask"]
    n = len(ids)
    anchors = n - 1
    embeds = [F.embedding(torch.tensor([ids[t + 1 + k] if t + 1 + k < n else 0 for t in range(anchors)]),
                          teacher.embed)[None] for k in range(steps)]
    hidden = drafter(sample["aux"][None, :anchors].float(), embeds, torch.arange(anchors))
    losses = torch.zeros(steps)
    for k in range(steps):
        for t in range(anchors):
            p = t + 1 + k
            if p >= n:
                continue
            weight = 1.0 if p + 1 < n and mask[p + 1] else w
            target = (teacher.states(sample["last"][p].float()) @ teacher.head.T).softmax(-1)
            log_q = drafter.lm_head(hidden[k][0, t]).log_softmax(-1)
            losses[k] += weight * -(target * log_q).sum()
    return losses


@pytest.mark.parametrize("kind", ["llama", "deepseek_mla"])
def test_objective_matches_hand_indexed_reference_and_ignores_padding(workspace, kind):
    config = target_config(workspace / "artifacts" / "target")
    record = json.loads((workspace / "artifacts" / "target" / "target.json").read_text())
    d2t = torch.from_numpy(np.load(workspace / "artifacts" / "vocab" / "d2t.npy"))
    teacher = load_teacher(record, config, d2t, pre_norm=True)
    torch.manual_seed(1)
    drafter = Drafter(DrafterConfig.from_target(config, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=AUX_IDS,
                                                drafter=kind))
    rng = torch.Generator().manual_seed(2)
    samples = []
    for n in (9, 6):
        samples.append({"input_ids": torch.randint(0, VOCAB, (n,), generator=rng, dtype=torch.int32),
                        "loss_mask": (torch.arange(n) % 3 != 0).to(torch.uint8),
                        "aux": torch.randn(n, 3 * HIDDEN, generator=rng).bfloat16().float(),
                        "last": torch.randn(n, HIDDEN, generator=rng).bfloat16().float()})
    loss_module = DraftLoss(drafter, teacher, ttt_steps=3, chunk_size=4)
    batch = batch_of(samples, ttt_steps=3, max_seq_len=64, prompt_loss_weight=0.3)
    _, losses, _ = loss_module(batch, torch.ones(3))
    expected = sum(reference_losses(drafter, teacher, s, 3, 0.3) for s in samples)
    torch.testing.assert_close(losses, expected.detach(), rtol=1e-4, atol=1e-4)


def test_teacher_applies_final_norm_and_draft_rows_of_an_untied_sharded_head(tmp_path):
    model = tiny_llama(tied=False)
    record = write_target(tmp_path, model)
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # replaces the single file with shards
    assert (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "model.safetensors").unlink(missing_ok=True)
    ids = torch.arange(3, VOCAB, 7)
    d2t = ids - torch.arange(len(ids))
    teacher = load_teacher(record, target_config(tmp_path), d2t, pre_norm=True)
    tokens = np.arange(20, dtype=np.int32)
    _, last = capture(model, tokens)
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens).long()[None]).logits[0]
        torch.testing.assert_close(teacher.states(last) @ teacher.head.T, logits[:, ids], rtol=1e-4, atol=1e-4)
    assert teacher.full_head is None  # only the draft rows unless asked
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    whole = load_teacher(record, target_config(tmp_path), d2t, pre_norm=True, t2d=t2d)
    expected = torch.isin(logits.argmax(-1), ids)
    assert 0 < int(expected.sum()) < len(tokens)  # both kinds of position, or the check shows nothing
    assert torch.equal(whole.in_draft_vocab(last, chunk_size=7), expected)
    assert torch.equal(whole.in_draft_vocab(last.view(4, 5, HIDDEN), chunk_size=3), expected.view(4, 5))


def test_a_tied_teachers_whole_head_is_its_embedding_one_copy_on_the_device(workspace):
    record = json.loads((workspace / "artifacts" / "target" / "target.json").read_text())
    d2t = torch.from_numpy(np.load(workspace / "artifacts" / "vocab" / "d2t.npy"))
    t2d = torch.from_numpy(np.load(workspace / "artifacts" / "vocab" / "t2d.npy"))
    teacher = load_teacher(record, target_config(workspace / "artifacts" / "target"), d2t, pre_norm=True,
                           t2d=t2d).to(torch.device("cpu"), torch.float64)
    assert teacher.full_head is teacher.embed and teacher.drafted.sum() == DRAFT_VOCAB


# ----------------------------------------------------------------------------------- real runs


def test_run_learns_reports_per_step_metrics_and_writes_a_valid_drafter(trained):
    paths, record = trained
    steps = 3
    assert record["steps"] == 16 and record["resumed_from_step"] == 0
    for split in ("train", "heldout"):
        assert len(record["final"][split]["loss"]) == len(record["final"][split]["top1"]) == steps
    assert record["final"]["heldout"]["top1"][0] > 0
    lines = paths.curve.read_text().splitlines()
    header = lines[0].split(",")
    assert {"step", "loss", "lr", "top1_0", "top1_2", "loss_2"} <= set(header)
    losses = [float(line.split(",")[header.index("loss")]) for line in lines[1:]]
    assert len(losses) == 16 and np.mean(losses[-3:]) < 0.85 * np.mean(losses[:3]), losses
    assert record["final"]["train"]["top1"][0] > 0.15  # from ~1/128
    assert "top1_0" in paths.heldout_curve.read_text().splitlines()[0]
    assert validate(paths.out, LAYERS, HIDDEN, VOCAB) == []
    config = json.loads((paths.out / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX_IDS
    assert config["tie_word_embeddings"] is False and config["draft_vocab_size"] == DRAFT_VOCAB
    saved = weights(paths.out)
    assert torch.equal(saved["d2t"], torch.from_numpy(np.load(paths.vocab / "d2t.npy")))


def test_mla_drafter_run_learns_and_writes_a_valid_mla_drafter(trained, workspace, tmp_path, monkeypatch):
    """train.drafter: deepseek_mla through the whole stage: it learns as the Llama drafter does and
    exports the checkpoint vLLM's Eagle3DeepseekV2ForCausalLM loads."""
    monkeypatch.chdir(tmp_path)
    paths = paths_for(workspace, tmp_path)
    record = train(small_params(drafter="deepseek_mla"), paths)
    assert validate(paths.out, LAYERS, HIDDEN, VOCAB) == []
    config = json.loads((paths.out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["kv_lora_rank"] == 512
    assert "midlayer.self_attn.kv_b_proj.weight" in weights(paths.out)
    llama_top1 = trained[1]["final"]["train"]["top1"][0]
    assert record["final"]["train"]["top1"][0] > 0.15 and record["final"]["train"]["top1"][0] > 0.5 * llama_top1
    with pytest.raises(TrainError, match="is a deepseek_mla drafter"):
        train(small_params(init_from=str(paths.out), epochs=1), paths_for(workspace, tmp_path / "again"))


@pytest.mark.parametrize("instructions", [True, False], ids=["bf16-cpu", "avx512-only-cpu"])
def test_cpu_bf16_runs_the_drafter_in_bf16_where_the_cpu_computes_it_and_learns_as_fp32_does(
        trained, workspace, tmp_path, monkeypatch, instructions):
    from eagle3.training import loop

    monkeypatch.setattr(loop, "cpu_computes", lambda dtype: instructions)  # else emulated: 4x slower than fp32
    monkeypatch.chdir(tmp_path)
    seen: set[torch.dtype] = set()
    original = Drafter.step

    def step(self, embeds, hidden, position_ids, cache):
        out = original(self, embeds, hidden, position_ids, cache)
        seen.add(cache.values[-1].dtype)  # the v_proj output: a matmul under the autocast
        return out

    monkeypatch.setattr(Drafter, "step", step)
    record = train(small_params(cpu_bf16=True), paths_for(workspace, tmp_path))
    assert seen == {torch.bfloat16 if instructions else torch.float32}
    assert record["compute"] == ("bf16 autocast" if instructions else "float32")
    fp32 = trained[1]["final"]
    assert record["final"]["train"]["top1"][0] > 0.15
    assert abs(record["final"]["train"]["loss"][0] - fp32["train"]["loss"][0]) < 0.1 * fp32["train"]["loss"][0]
    assert validate(paths_for(workspace, tmp_path).out, LAYERS, HIDDEN, VOCAB) == []


def test_rerun_resumes_at_the_end_without_training(trained, tmp_path, monkeypatch):
    paths, _ = trained
    monkeypatch.chdir(tmp_path)
    again = dataclasses.replace(paths, out=tmp_path / "drafter")
    record = train(small_params(log_every=5), again)  # an operational param: same fingerprint
    assert record["resumed_from_step"] == 16 and record["items"] == 0
    rerun = weights(again.out)
    assert all(torch.equal(tensor, rerun[name]) for name, tensor in weights(paths.out).items())


def test_out_of_vocab_weight_0_drops_the_positions_whose_target_argmax_is_no_draft_token(
        workspace, tmp_path, monkeypatch):
    """Every training batch, the first epoch's (found) and the later ones' (kept), weighs 0 exactly
    the positions where the target's argmax over its whole vocabulary is outside the draft vocab;
    the share reported is the one the target's own forward gives."""
    from eagle3.training import loop

    monkeypatch.chdir(tmp_path)
    model = tiny_llama()
    draft_ids = torch.arange(0, VOCAB, VOCAB // DRAFT_VOCAB)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = loop.train_step

    def train_step(run, batches, lr):
        seen.extend((b.next_weight.clone(), b.next_last.clone()) for b in batches)
        return original(run, batches, lr)

    monkeypatch.setattr(loop, "train_step", train_step)
    params = small_params(out_of_vocab_weight=0.0, prompt_loss_weight=1.0)
    record = train(params, paths_for(workspace, tmp_path))
    assert len(seen) == record["steps"] * params.batches_per_step
    with torch.no_grad():
        for weight, last in seen:
            inside = last.abs().sum(-1) > 0  # real positions: padding states are zeros
            argmax = model.lm_head(model.model.norm(last)).argmax(-1)
            assert torch.equal(weight, (inside & torch.isin(argmax, draft_ids)).float())

    positions = in_vocab = 0
    store = HiddenStore(workspace / "artifacts" / "hidden")
    for row, sample_id in enumerate(store.sample_ids):
        if not is_heldout(sample_id, params.eval_fraction):
            ids = torch.from_numpy(store.read_row(row).arrays["input_ids"][: params.max_seq_len]).long()
            with torch.no_grad():
                argmax = model(ids[None]).logits[0, 1:].argmax(-1)
            positions, in_vocab = positions + len(argmax), in_vocab + int(torch.isin(argmax, draft_ids).sum())
    assert record["out_of_vocab_weight"] == 0.0
    assert 0.1 < record["out_of_vocab_share"] < 0.9
    assert abs(record["out_of_vocab_share"] - (1 - in_vocab / positions)) < 0.02  # bf16 states: a near tie may flip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, params: TrainParams, paths: Paths) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    train(params, paths)


def run_ranks(world: int, params: TrainParams, paths: Paths) -> None:
    port = free_port()
    ranks = [FORK.Process(target=_rank_main, args=(r, world, port, params, paths)) for r in range(world)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
    assert [p.exitcode for p in ranks] == [0] * world


def assert_same_weights(got: Path, expected: Path) -> None:
    reference = weights(expected)
    trained = weights(got)
    assert trained.keys() == reference.keys()
    for name, tensor in trained.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_gloo_processes_train_the_same_weights_as_one(trained, workspace, tmp_path, monkeypatch, fsdp):
    reference, _ = trained
    monkeypatch.chdir(tmp_path)
    paths = paths_for(workspace, tmp_path)
    run_ranks(2, small_params(fsdp=fsdp), paths)
    assert_same_weights(paths.out, reference.out)


def _train_and_die_in_checkpoint(number: int, params: TrainParams, paths: Paths) -> None:
    """Trains, and kills itself with SIGKILL halfway through writing checkpoint `number`."""
    real_save = train_state.save_file
    calls = []

    def torn_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == number:
            Path(path).write_bytes(b"torn")
            os.kill(os.getpid(), signal.SIGKILL)
        real_save(tensors, path, metadata=metadata)

    train_state.save_file = torn_save
    train(params, paths)


def killed_in_checkpoint(paths: Paths, params: TrainParams | None = None, number: int = 2) -> None:
    """A one-process run (small_params() by default) killed with SIGKILL while writing its checkpoint
    `number` (the second: step 6)."""
    child = FORK.Process(target=_train_and_die_in_checkpoint, args=(number, params or small_params(), paths))
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL


def test_kill_9_mid_epoch_then_resume_gives_bitwise_equal_weights(trained, workspace, tmp_path, monkeypatch):
    reference, _ = trained
    monkeypatch.chdir(tmp_path)
    paths = paths_for(workspace, tmp_path)
    killed_in_checkpoint(paths)
    assert not paths.out.exists()
    survivors = sorted(p.name for p in paths.run.iterdir())
    assert survivors[-1] == "step-00000003" and any(s.startswith(".step-00000006") for s in survivors)
    saved = json.loads((paths.run / "step-00000003" / "state.json").read_text())
    assert saved["step_in_epoch"] != 0  # mid-epoch

    record = train(small_params(), paths)
    assert record["resumed_from_step"] == 3
    assert sorted(p.name for p in paths.run.iterdir()) == ["step-00000016"]
    expected = weights(reference.out)
    resumed = weights(paths.out)
    assert all(torch.equal(resumed[name], expected[name]) for name in expected), "resumed weights differ"


def test_fsdp_ranks_resume_a_single_process_checkpoint(trained, workspace, tmp_path, monkeypatch):
    """Checkpoints hold whole tensors: 2 FSDP ranks take over mid-epoch from 1 process's step 3 and
    end where the uninterrupted run ends."""
    reference, _ = trained
    monkeypatch.chdir(tmp_path)
    paths = paths_for(workspace, tmp_path)
    killed_in_checkpoint(paths)
    run_ranks(2, small_params(fsdp=True), paths)
    assert json.loads((tmp_path / "metrics" / "train.json").read_text())["resumed_from_step"] == 3
    assert_same_weights(paths.out, reference.out)


# ---------------------------------------------------------------------------------------- init_from


def drafter_checkpoint(folder: Path, aux_ids: list[int], hidden: int = HIDDEN) -> tuple[torch.Tensor, torch.Tensor]:
    """A servable drafter whose vocab map differs from artifacts/vocab's (every 4th id from 1)."""
    config = LlamaConfig(hidden_size=hidden, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, rope_theta=10000.0)
    torch.manual_seed(3)
    drafter = Drafter(DrafterConfig.from_target(config, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=aux_ids))
    ids = torch.arange(1, VOCAB, VOCAB // DRAFT_VOCAB)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    d2t = ids - torch.arange(DRAFT_VOCAB)
    save_drafter(folder, drafter, d2t, t2d)
    return d2t, t2d


def test_init_from_keeps_the_drafters_vocab_map(workspace, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d2t, t2d = drafter_checkpoint(tmp_path / "init", AUX_IDS)
    paths = paths_for(workspace, tmp_path)
    with pytest.raises(TrainError, match=f"holds another: set vocab.from_drafter: {tmp_path / 'init'}"):
        train(small_params(init_from=str(tmp_path / "init"), epochs=1), paths)
    # what the vocab stage writes with vocab.from_drafter
    paths = dataclasses.replace(paths, vocab=tmp_path / "vocab")
    paths.vocab.mkdir()
    np.save(paths.vocab / "d2t.npy", d2t.numpy())
    np.save(paths.vocab / "t2d.npy", t2d.numpy())
    record = train(small_params(init_from=str(tmp_path / "init"), epochs=1), paths)
    saved = weights(paths.out)
    assert torch.equal(saved["d2t"], d2t) and torch.equal(saved["t2d"], t2d)
    assert saved["midlayer.mlp.up_proj.weight"].shape == (96, HIDDEN)  # the drafter's own geometry
    assert record["steps"] > 0 and validate(paths.out, LAYERS, HIDDEN, VOCAB) == []


@pytest.mark.parametrize(
    "aux_ids, hidden, field",
    [([1, 2], HIDDEN, "eagle_aux_hidden_state_layer_ids"), (AUX_IDS, 32, "target_hidden_size")],
)
def test_init_from_rejects_a_mismatched_drafter_naming_the_field(workspace, tmp_path, aux_ids, hidden, field):
    init = tmp_path / "init"
    drafter_checkpoint(init, aux_ids)
    if hidden != HIDDEN:  # a drafter made for a target of another width
        cfg = json.loads((init / "config.json").read_text())
        cfg["target_hidden_size"] = hidden
        (init / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TrainError, match=field):
        train(small_params(init_from=str(init)), paths_for(workspace, tmp_path))


def test_params_that_cannot_work_are_refused_by_name():
    with pytest.raises(TrainError, match="batches_per_step=3 is not a positive multiple of the world size 2"):
        check_params(small_params(batches_per_step=3), world=2)
    with pytest.raises(TrainError, match="max_seq_len=200 exceeds max_tokens_per_batch"):
        check_params(small_params(max_seq_len=200), world=1)
    with pytest.raises(TrainError, match=r"train.dropout=1.0 must be in \[0, 1\)"):
        check_params(small_params(dropout=1.0), world=1)
    with pytest.raises(TrainError, match=r"train.out_of_vocab_weight=1.5 must be in \[0, 1\]"):
        check_params(small_params(out_of_vocab_weight=1.5), world=1)
    with pytest.raises(TrainError, match=r"train.drafter='mla' is not one of \['llama', 'deepseek_mla'\]"):
        check_params(small_params(drafter="mla"), world=1)


def test_samples_without_generated_tokens_train_only_at_a_positive_prompt_weight(capsys):
    """Conversations kept with their dataset answers have no generated token: context weight or nothing."""
    from types import SimpleNamespace

    store = SimpleNamespace(num_tokens=np.array([50, 60, 40, 30]), num_loss_tokens=np.array([20, 0, 0, 10]),
                            sample_ids=["p0:0", "a1", "a2", "p3:0"])
    both = make_plan(small_params(prompt_loss_weight=0.5, eval_fraction=0.0, batches_per_step=1), store)
    assert both.train_samples == 4 and "skipped" not in capsys.readouterr().err
    generated_only = make_plan(small_params(prompt_loss_weight=0.0, eval_fraction=0.0, batches_per_step=1), store)
    assert generated_only.train_samples == 2
    assert sorted(r for step in generated_only.epochs[0] for batch in step for r in batch) == [0, 3]
    assert "2 samples without generated tokens (conversations with dataset answers) are skipped" in capsys.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="mallopt is glibc's")
def test_training_on_cpu_keeps_freed_memory_on_the_heap():
    from eagle3.malloc import keep_freed_memory

    assert keep_freed_memory()  # every mallopt call was accepted
