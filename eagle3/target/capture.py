"""Forward hooks on an HF target that keep the states an EAGLE-3 drafter reads, nothing else.

Layer ids are vLLM's (id 0 = the embedding output, id X = the output of decoder layer X-1 = HF
hidden_states[X]); `last` is the last decoder layer's output before the final norm, what an
engine captures.
"""
from __future__ import annotations

from typing import Any

import torch


class Capture:
    """Forward hooks that keep the outputs of the needed modules, nothing else."""

    def __init__(self, model: Any, aux_ids: list[int]):
        decoder = model.get_decoder()
        layers = decoder.layers
        self.names = [f"aux{i}" for i in aux_ids] + ["last"]
        modules = [decoder.embed_tokens if i == 0 else layers[i - 1] for i in aux_ids] + [layers[-1]]
        # Under device_map the layers live on several GPUs: the states are gathered on the first.
        self.device = decoder.embed_tokens.weight.device
        self.outputs: dict[str, torch.Tensor] = {}
        self.handles = [m.register_forward_hook(self._keep(name)) for name, m in zip(self.names, modules)]

    def _keep(self, name: str):
        def hook(module: Any, args: Any, output: Any) -> None:
            self.outputs[name] = (output[0] if isinstance(output, tuple) else output).to(self.device)
        return hook

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux states concatenated in layer order [..., n*H], last state [..., H]) of the last
        forward; forgets them, so the next forward's tensors are the only ones kept."""
        aux = torch.cat([self.outputs[n] for n in self.names[:-1]], dim=-1)
        last = self.outputs["last"]
        self.outputs.clear()
        return aux, last
