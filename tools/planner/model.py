"""First-principles time, disk and cost of each stage; the planner divides by calibrated efficiencies.

Every `*_roofline_s` function returns the seconds a stage would take at 100% of the hardware's peak
(FLOP/s or bytes/s, whichever binds); a measured run gives efficiency = roofline / measured, and a
projection is roofline / efficiency. Conventions (shared with benchmarks/extract_bench.py and
benchmarks/train_bench.py, so their figures calibrate the same quantities):
- a forward costs 2 FLOPs per active matmul weight per token, plus causal attention at 4 * hidden
  FLOPs per visible key, i.e. 2 * layers * seq * hidden per token averaged over a sequence of `seq`;
- a training step costs 3x its forward (forward + backward).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tools.planner.profiles import DrafterGeometry, Hardware, Target

AUX_STATES = 3  # low, middle, high aux layers; plus the last layer's state: the store keeps 4 states per token
BF16 = 2


@dataclass(frozen=True)
class Workload:
    samples: int
    prompt_tokens: float  # mean per sample
    completion_tokens: float  # mean per sample
    epochs: int = 10
    ttt_steps: int = 7
    concurrency: int = 128  # sequences decoded together
    weights: str = "bf16"  # weight format served (a key of the target's weight_bytes_per_param)
    tokens_per_device_step: int = 16384  # training tokens per GPU per optimizer step
    link_gbit_s: float = 10.0  # network of the rented box: target weights in, hidden store out
    extract_engine: str = "vllm"  # vllm: the serving engine extracts, every GPU busy; hf: transformers
    store_dtype: str = "bf16"  # extract.store_dtype: bf16 (lossless) | fp8_e4m3

    @property
    def seq_len(self) -> float:
        return self.prompt_tokens + self.completion_tokens

    @property
    def tokens(self) -> float:
        return self.samples * self.seq_len


def ring_allreduce_s(nbytes: float, devices: int, link_bytes_s: float) -> float:
    """A ring all-reduce sends 2 (n-1)/n of the buffer over each device's link."""
    if devices <= 1:
        return 0.0
    return 2 * (devices - 1) / devices * nbytes / link_bytes_s


def attention_flops_per_token(target: Target, seq: float) -> float:
    return 2 * target.layers * seq * target.hidden_size


def forward_flops_per_token(target: Target, seq: float) -> float:
    """The target's forward without the lm_head (what extraction and prefill compute)."""
    return 2 * target.body_params + attention_flops_per_token(target, seq)


def weights_read_per_step(target: Target, weights: str, batch: float) -> float:
    """Bytes of weights one decode step reads: all of a dense model; of a MoE, the experts any of the
    `batch` tokens routes to (each token picks k of E experts: a given expert is untouched with
    probability (1 - k/E)^batch)."""
    total = target.weight_bytes(weights)
    if target.moe is None:
        return total
    per_param = target.weight_bytes_per_param[weights]
    touched = 1 - (1 - target.moe.experts_per_token / target.moe.experts) ** batch
    return total - target.moe.routed_params * per_param * (1 - touched)


def kv_bytes_per_value(weights: str) -> int:
    return 4 if weights == "fp32" else BF16  # the cache takes the compute dtype: fp32 only with fp32 weights


def decode_step_s(target: Target, hw: Hardware, weights: str, batch: float, context: float) -> float:
    """One decode step of `batch` sequences at mean `context`: memory-bound (weights + KV cache read) or
    compute-bound, whichever is slower, plus tensor-parallel all-reduces (2 per layer of batch x hidden)."""
    kv = batch * context * target.kv_bytes_per_token * kv_bytes_per_value(weights) / BF16
    memory_s = (weights_read_per_step(target, weights, batch) + kv) / (hw.devices * hw.memory_tb_s * 1e12)
    flops = batch * (2 * target.active_params + 2 * attention_flops_per_token(target, context))
    compute_s = flops / (hw.devices * hw.matmul_tflops * 1e12)
    comm_s = 2 * target.layers * ring_allreduce_s(batch * target.hidden_size * BF16, hw.devices, hw.link_gb_s * 1e9)
    return max(memory_s, compute_s) + comm_s


def generation_roofline_s(target: Target, hw: Hardware, work: Workload) -> float:
    """Prefill of every prompt (compute-bound) plus decode of every completion token, `concurrency`
    sequences per step at the mean context of a completion's midpoint."""
    prefill = work.samples * work.prompt_tokens * forward_flops_per_token(target, work.prompt_tokens)
    prefill_s = prefill / (hw.devices * hw.matmul_tflops * 1e12)
    batch = min(work.concurrency, work.samples)
    steps = work.samples * work.completion_tokens / batch
    context = work.prompt_tokens + work.completion_tokens / 2
    return prefill_s + steps * decode_step_s(target, hw, work.weights, batch, context)


def devices_per_replica(target: Target, hw: Hardware, weights: str, usable: float = 0.9) -> int:
    """GPUs one copy of the weights needs (a fraction `usable` of memory holds weights, the rest activations)."""
    need = math.ceil(target.weight_bytes(weights) / (hw.memory_gb * 1e9 * usable))
    if need > hw.devices:
        raise ValueError(f"{target.name} in {weights} ({target.weight_bytes(weights) / 1e9:,.0f} GB) does not fit "
                         f"in {hw.name} ({hw.devices} x {hw.memory_gb:g} GB)")
    return need


def extraction_roofline_s(target: Target, hw: Hardware, tokens: float, seq: float, weights: str) -> float:
    """Prefill compute over every token. A target that fits one GPU runs one copy per GPU (torchrun); a
    larger one is split by layers over all GPUs (extract.device_map: auto, one process), so only one
    GPU computes at a time."""
    replicas = hw.devices if devices_per_replica(target, hw, weights) == 1 else 1
    return tokens * forward_flops_per_token(target, seq) / (replicas * hw.matmul_tflops * 1e12)


def engine_layout(target: Target, hw: Hardware, weights: str) -> tuple[int, int]:
    """(GPUs per engine replica, replicas) of extraction through the serving engine: each replica is a
    TP/EP group just large enough to hold the weights (the smallest divisor of the GPU count that does),
    and the GPUs left over run more replicas (DP), so every GPU computes."""
    need = devices_per_replica(target, hw, weights)
    group = next(d for d in range(need, hw.devices + 1) if hw.devices % d == 0)
    return group, hw.devices // group


def engine_extraction_roofline_s(target: Target, hw: Hardware, tokens: float, seq: float, weights: str) -> float:
    """Prefill compute over every token with all GPUs busy (extract.engine: vllm), plus each replica's
    tensor-parallel all-reduces: 2 per layer of its tokens x hidden in bf16 (as decode_step_s counts them)."""
    group, replicas = engine_layout(target, hw, weights)
    compute_s = tokens * forward_flops_per_token(target, seq) / (hw.devices * hw.matmul_tflops * 1e12)
    comm_s = 2 * target.layers * ring_allreduce_s(tokens / replicas * target.hidden_size * BF16, group,
                                                  hw.link_gb_s * 1e9)
    return compute_s + comm_s


def raw_bytes_per_token(target: Target) -> float:
    """3 aux states + the last layer's state, hidden size each, bf16, before compression."""
    return (AUX_STATES + 1) * target.hidden_size * BF16


def compression_s(target: Target, hw: Hardware, tokens: float, compress_mb_s_per_core: float) -> float:
    """Host CPU time to compress the states, all cores in parallel (overlaps the GPU work)."""
    return tokens * raw_bytes_per_token(target) / (hw.cpu_cores * compress_mb_s_per_core * 1e6)


def drafter_params(target: Target) -> float:
    d = target.drafter
    return AUX_STATES * target.hidden_size * d.hidden_size + d.layer_params() + d.hidden_size * d.draft_vocab


def training_flops_per_token(target_hidden: int, d: DrafterGeometry, seq: float, ttt_steps: int) -> float:
    """benchmarks/train_bench.py's model FLOPs per token: fc fwd+bwd once; per TTT step the layer and draft
    lm_head fwd+bwd; the target head's forward over the draft vocab once (all steps read the same
    positions' distributions); attention fwd+bwd where step k's query t sees t+1 causal keys and k
    diagonal ones."""
    q = d.heads * d.head_dim
    dense = (6 * AUX_STATES * target_hidden * d.hidden_size
             + ttt_steps * 6 * (d.layer_params() + d.hidden_size * d.draft_vocab) + 2 * target_hidden * d.draft_vocab)
    visible_per_token = sum((seq + 1) / 2 + k for k in range(ttt_steps))
    return dense + 3 * 4 * q * visible_per_token


def training_roofline_s(target: Target, hw: Hardware, tokens: float, seq: float, ttt_steps: int,
                        tokens_per_device_step: int) -> tuple[float, float]:
    """(compute seconds at peak, data-parallel gradient all-reduce seconds) for `tokens` drafter tokens."""
    compute = tokens * training_flops_per_token(target.hidden_size, target.drafter, seq, ttt_steps)
    steps = tokens / (hw.devices * tokens_per_device_step)
    grads = 4 * drafter_params(target)  # fp32 master weights, fp32 gradients
    return compute / (hw.devices * hw.matmul_tflops * 1e12), steps * ring_allreduce_s(grads, hw.devices,
                                                                                       hw.link_gb_s * 1e9)


def hidden_store_bytes(target: Target, tokens: float, stored_over_raw: float) -> float:
    return tokens * raw_bytes_per_token(target) * stored_over_raw


def transfer_s(nbytes: float, link_gbit_s: float) -> float:
    return nbytes * 8 / (link_gbit_s * 1e9)
