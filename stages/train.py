"""Stage `train`: an EAGLE-3 drafter from the hidden-state store, servable as-is (artifacts/drafter).

    python -m stages.train                         # one process: CPU, or one GPU
    torchrun --nproc_per_node 8 -m stages.train    # DDP (FSDP with train.fsdp), one GPU per process (gloo on CPU)

Reads artifacts/hidden (tokens, loss mask, the target's aux and last states), artifacts/vocab
(d2t/t2d; a drafter given as `train.init_from` brings its own and keeps it, its lm_head rows belong
to it, and artifacts/vocab must hold the same: vocab.from_drafter) and artifacts/target (of the
target's weights only embed_tokens, the final norm and lm_head).
Training-time test unrolls `ttt_steps` steps against the target's distribution. Writes
artifacts/drafter (validated before the stage succeeds), metrics/train.json and the training
curves; run/train/ holds the resumable state, and a rerun resumes from it when the params and
inputs are the same. With train.source online or hybrid, a capture process per rank computes the
states (train.capture_engine: hf, the target's HF forward; vllm, the capture server with the serve
section's parallel sizes, started and stopped by this stage unless `make serve-capture` runs it).
"""

from __future__ import annotations

from eagle3.cli import run_stage
from eagle3.engine.server import ServeParams
from eagle3.engine.state import require_accelerators_free
from eagle3.extraction.params import ExtractParams
from eagle3.params import load_section
from eagle3.training.loop import train
from eagle3.training.online import EngineCapture
from eagle3.training.params import TrainParams


def main() -> None:
    params = load_section("train", TrainParams)
    if params.source != "store" and params.capture_engine == "vllm":  # the capture server is ours to use
        timeout_s = load_section("extract", ExtractParams).engine_timeout_s
        train(params, engine=EngineCapture(load_section("serve", ServeParams), timeout_s))
    else:
        require_accelerators_free("train")
        train(params)


if __name__ == "__main__":
    run_stage("train", __doc__, main)
