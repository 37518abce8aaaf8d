"""The train stage's params, its files, and the checks of both before anything is loaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3.errors import PipelineError
from eagle3.extraction.params import ENGINES, TRAIN_SOURCES
from eagle3.metrics import METRICS_DIR
from eagle3.model.checkpoint import WEIGHT_DTYPES
from eagle3.model.drafter import DRAFTERS

HEAD_INITS = ("target", "random")
# Params that change how a run is watched or saved, not the weights it produces: changing them
# does not stop a resume.
OPERATIONAL = ("log_every", "checkpoint_every", "eval_every", "num_workers", "compile", "save_dtype", "fsdp",
               "prefetch_batches", "prefetch_dir", "capture_gpus")


class TrainError(PipelineError, ValueError):
    pass


@dataclass
class TrainParams:
    init_from: str | None  # servable drafter directory to fine-tune (its d2t/t2d are kept)
    drafter: str  # llama (grouped-query attention) | deepseek_mla (latent attention, DeepSeek-V3/Kimi targets)
    hidden_size: int | None  # drafter width; None: the target's (then it shares its embeddings)
    intermediate_size: int | None  # None: the target's
    # "target": a new drafter's lm_head and final norm start as the target's (its lm_head rows of the
    # draft vocabulary), so the drafter only has to learn which state to hand them; "random": nn.Linear init.
    head_init: str
    ttt_steps: int
    step_decay: float  # TTT step k weighs step_decay**k
    prompt_loss_weight: float  # weight of rows whose predicted token is not generated
    # times the weight of rows where the target's argmax over its whole vocabulary is no draft token:
    # there the drafter cannot be right (EAGLE-3's position mask is 0); 1 weighs them as any other
    out_of_vocab_weight: float
    epochs: int
    max_seq_len: int  # longer samples are cut
    max_tokens_per_batch: int  # padded tokens of one forward (rows x longest)
    batches_per_step: int  # batches per optimizer step over all ranks; a multiple of the world size
    length_group: int  # shuffled samples sorted by length together before batching
    lr: float
    min_lr_ratio: float  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int
    weight_decay: float  # on matrices only
    dropout: float  # on the drafter layer's attention and MLP outputs while training
    beta1: float
    beta2: float
    adam_eps: float
    grad_clip: float  # max global grad norm
    eval_fraction: float  # held-out share of samples, picked by a hash of the sample id
    eval_every: int  # steps between held-out evaluations; 0: only at the end
    log_every: int
    checkpoint_every: int
    seed: int
    num_workers: int  # store-reading threads per rank
    compile: bool  # torch.compile the drafter
    cpu_bf16: bool  # bf16 autocast on CPU too (GPUs always use it): 1.3x with AVX512-BF16, slower without
    fsdp: bool  # several processes: shard weights, gradients and AdamW state instead of replicating them
    ce_chunk_size: int
    save_dtype: str  # float32 | bfloat16 | float16 | target (the target's dtype)
    # store: states read from artifacts/hidden; online: a capture process beside the trainer computes
    # each batch's (artifacts/hidden then holds token ids only); hybrid: online for the first epoch,
    # whose states fill run/train/hybrid-store, which the later epochs read (eagle3/training/online.py)
    source: str
    prefetch_batches: int  # online/hybrid: batches of states the capture process keeps ready
    prefetch_dir: str | None  # where they wait; None: run/train/prefetch (a tmpfs such as /dev/shm keeps them in RAM)
    capture_max_tokens: int  # padded tokens per capture forward; a training batch may take several
    capture_gpus: int  # GPUs for the capture, the first ones; the training ranks take the next; 0: they share
    # online/hybrid: hf, the target's HF forward in a capture process per rank; vllm, the extract
    # stage's capture server (serve.* tensor / data / expert parallel sizes), asked by those processes
    capture_engine: str


@dataclass(frozen=True)
class Paths:
    hidden: Path = Path("artifacts/hidden")
    vocab: Path = Path("artifacts/vocab")
    target: Path = Path("artifacts/target")
    out: Path = Path("artifacts/drafter")
    run: Path = Path("run/train")
    hybrid: Path = Path("run/train/hybrid-store")  # train.source: hybrid, the first epoch's states
    server: Path = Path("run/server")  # train.capture_engine: vllm, the capture server's state (eagle3/engine/state.py)
    curve: Path = METRICS_DIR / "train_curve.csv"
    heldout_curve: Path = METRICS_DIR / "train_heldout_curve.csv"


def check_params(params: TrainParams, world: int) -> None:
    problems = []
    if params.ttt_steps < 1:
        problems.append(f"ttt_steps={params.ttt_steps} must be >= 1")
    if params.max_seq_len < 2:
        problems.append(f"max_seq_len={params.max_seq_len} must be >= 2 (one anchor needs two tokens)")
    if params.max_seq_len > params.max_tokens_per_batch:
        problems.append(
            f"max_seq_len={params.max_seq_len} exceeds max_tokens_per_batch={params.max_tokens_per_batch}: "
            "a long sample would fit no batch"
        )
    if params.batches_per_step < 1 or params.batches_per_step % world:
        problems.append(
            f"batches_per_step={params.batches_per_step} is not a positive multiple of the world size {world} "
            "(every rank takes an equal share of a step's batches)"
        )
    if not 0 <= params.eval_fraction < 1:
        problems.append(f"eval_fraction={params.eval_fraction} must be in [0, 1)")
    if not 0 <= params.dropout < 1:
        problems.append(f"dropout={params.dropout} must be in [0, 1)")
    if params.step_decay <= 0 or params.prompt_loss_weight < 0:
        problems.append("step_decay must be > 0 and prompt_loss_weight >= 0")
    if not 0 <= params.out_of_vocab_weight <= 1:
        problems.append(f"out_of_vocab_weight={params.out_of_vocab_weight} must be in [0, 1]")
    for name in ("epochs", "log_every", "checkpoint_every", "length_group", "ce_chunk_size"):
        if getattr(params, name) < 1:
            problems.append(f"{name}={getattr(params, name)} must be >= 1")
    if params.drafter not in DRAFTERS:
        problems.append(f"drafter={params.drafter!r} is not one of {list(DRAFTERS)}")
    if params.head_init not in HEAD_INITS:
        problems.append(f"head_init={params.head_init!r} is not one of {list(HEAD_INITS)}")
    if params.source not in TRAIN_SOURCES:
        problems.append(f"source={params.source!r} is not one of {list(TRAIN_SOURCES)}")
    for name in ("prefetch_batches", "capture_max_tokens"):
        if getattr(params, name) < 1:
            problems.append(f"{name}={getattr(params, name)} must be >= 1")
    if params.capture_gpus < 0:
        problems.append(f"capture_gpus={params.capture_gpus} must be >= 0")
    if params.capture_engine not in ENGINES:
        problems.append(f"capture_engine={params.capture_engine!r} is not one of {list(ENGINES)}")
    if params.save_dtype not in (*WEIGHT_DTYPES, "target"):
        problems.append(f"save_dtype={params.save_dtype!r} is not one of {[*WEIGHT_DTYPES, 'target']}")
    if problems:
        raise TrainError("; ".join(f"train.{p}" for p in problems))
