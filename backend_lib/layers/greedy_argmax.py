"""Greedy steps' argmax with each row split across many programs (Triton, CUDA).

torch.argmax reduces a row of the vocabulary (152k logits at the Qwen2.5 shape) with one
block, a serial walk that outlasts the few microseconds its bytes take. Here a grid of (chunks
x rows) programs each finds its chunk's winner, and one program per row picks among them,
as the split sampler's first pass does for greedy rows (layers/sampling_split.py, whose lane
helpers these kernels share): the largest logit, the lowest index on ties, index 0 for a row
of -inf. One difference from torch.argmax: NaN logits are passed over (torch returns a NaN's
index). Both kernels launch with PDL where the GPU has it: the combine starts while the chunks
run (layers/decode_gemv.py explains the chain).
"""
from __future__ import annotations

import torch

from .sampling_split import BLOCK, PASS_WARPS, _pow2, chunk_size
from .triton_support import pdl_launch, pdl_release_dependents, pdl_supported, tl, triton  # noqa: F401

# Steps of more rows keep torch.argmax: bench.decode compares the two at batch 1 and 8 only.
GREEDY_ARGMAX_MAX_ROWS = 8

if triton is not None:
    from .sampling_split import _keep_better, _lane_winner, _winner

    @triton.jit
    def _argmax_chunks(logits_ptr, stride, V, part_f, part_i, C, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                       USE_PDL: tl.constexpr):
        """part_f / part_i [S, C]: chunk c of row `row`'s best logit and its lowest index."""
        c = tl.program_id(0)
        row = tl.program_id(1)
        if USE_PDL:
            pdl_release_dependents()
            tl.extra.cuda.gdc_wait()
        row_ptr = logits_ptr + row.to(tl.int64) * stride
        best_v = tl.full((BLOCK,), float("-inf"), tl.float32)
        best_i = tl.zeros((BLOCK,), dtype=tl.int32)
        for sub in range(0, CHUNK, BLOCK):
            offs = c * CHUNK + sub + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            best_v, best_i = _keep_better(x, offs, best_v, best_i)
        best, tok = _lane_winner(best_v, best_i)
        tl.store(part_f + row * C + c, best)
        tl.store(part_i + row * C + c, tok)

    @triton.jit
    def _argmax_combine(part_f, part_i, C, out_ptr, CMAX: tl.constexpr, USE_PDL: tl.constexpr):
        row = tl.program_id(0)
        if USE_PDL:
            pdl_release_dependents()
            tl.extra.cuda.gdc_wait()
        tl.store(out_ptr + row, _winner(part_f, part_i, row, C, CMAX).to(tl.int64))


def pays(logits: torch.Tensor) -> bool:
    """Whether argmax_rows serves this step's logits (rows of one contiguous vocabulary)."""
    return triton is not None and logits.dim() == 2 and 0 < logits.shape[0] <= GREEDY_ARGMAX_MAX_ROWS \
        and logits.stride(1) == 1


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, V] (any float dtype, unit stride along V) -> int64 [S], torch.argmax's
    result (module docstring: NaN aside)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"argmax_rows: logits must be [rows, vocab] with a unit vocab stride; got "
                         f"{tuple(logits.shape)} strides {tuple(logits.stride())}")
    s, v = logits.shape
    chunk = chunk_size(s, v)
    c = -(-v // chunk)
    part_f = torch.empty(s * c, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(s * c, dtype=torch.int32, device=logits.device)
    out = torch.empty(s, dtype=torch.int64, device=logits.device)
    pdl = logits.is_cuda and pdl_supported(logits.device)
    _argmax_chunks[(c, s)](logits, logits.stride(0), v, part_f, part_i, c, CHUNK=chunk, BLOCK=BLOCK,
                           USE_PDL=pdl, num_warps=PASS_WARPS, **pdl_launch(pdl))
    _argmax_combine[(s,)](part_f, part_i, c, out, CMAX=_pow2(c), USE_PDL=pdl, num_warps=1, **pdl_launch(pdl))
    return out
