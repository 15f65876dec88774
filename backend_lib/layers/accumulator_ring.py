"""The fp32 accumulators that split-K one-token kernels add their partial sums into.

A split-K kernel (decode_gemv with split_k > 1, decode_oproj, decode_mlp) adds partial sums with
fp32 atomics, so its output buffer must be zero before its first program adds. Nothing can
zero it in the same kernel, and a memset per layer would be a kernel more. Instead the model
keeps one accumulator per layer for each such projection, and layer i's kernel zeroes layer
i - 1's (layer 0's: the last layer's). That buffer's only reader ran before layer i's kernel
(every kernel of the PDL chain waits for its predecessor, which waited for its own), and its
writer comes only in the next forward. Each accumulator is thus zeroed once a forward, after
its reader and before its writer, provided a forward runs all the ring's layers in order, as
the decode step does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AccumulatorRing:
    """One fp32 [1, H] accumulator per layer, and which one each layer's kernel zeroes (the
    previous layer's; layer 0: the last layer's). Needs two layers or more: with one, a layer
    would zero its own output."""
    buffers: torch.Tensor    # [num_layers, 1, H] fp32

    @classmethod
    def create(cls, num_layers: int, hidden: int, device) -> "AccumulatorRing":
        if num_layers < 2:
            raise ValueError(f"the accumulator ring needs 2 layers or more (got {num_layers})")
        return cls(torch.zeros(num_layers, 1, hidden, dtype=torch.float32, device=device))

    def for_layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer i's accumulator, the one layer i zeroes)."""
        return self.buffers[i], self.buffers[i - 1]   # i = 0: index -1, the last layer's
