"""The decode program's per-row inputs, from the step's packed metadata (decode_graphs.DecodeMeta),
in one kernel on CUDA.

Every decode step (CUDA graph or eager) first turns the metadata rows into what the model and
the sampler read: input ids (host-known, or the previous step's token from the relay), the
row's slot (padding rows: the scratch slot), the KV-cache slot of the new token, the rows' block
tables, sequence lengths, which rows sample a real output, where that token goes in the relay,
and the next positions. As torch ops that is ~20 small kernels at every batch size (~25 µs of a
0.72 ms batch-1 step on the H200, bench/RESULTS.md); here it is one launch. The step also
leaves `meta.pos` advanced for its valid rows (the metadata of the same rows' next step, which
a replayed graph reuses); the model reads the copy in `positions`.

`decode_inputs` picks the kernel on CUDA (BACKEND_LIB_DECODE_PREP=off: the torch ops);
`decode_inputs_torch` is the reference, used on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import envs

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    triton = tl = None
    HAS_TRITON = False


@dataclass
class DecodeInputs:
    ids: torch.Tensor           # [B] int64: the rows' input ids
    positions: torch.Tensor     # [B] int64: the rows' token positions (before this step advanced meta.pos)
    slot: torch.Tensor          # [B] int64: the request's slot; padding rows: the scratch slot
    slot_mapping: torch.Tensor  # [B] int64: KV-cache slot of the row's token (padding rows: 0)
    tables: torch.Tensor        # [B, max_blocks] int32: the rows' block tables
    seq_lens: torch.Tensor      # [B] int32: tokens in the KV cache with this one (padding rows: 0)
    samples: torch.Tensor       # [B] bool: the sampled token is a real output
    relay_dst: torch.Tensor     # [B] int64: where the sampled token goes in the relay (else the scratch slot)
    next_pos: torch.Tensor      # [B] int64: positions + 1, the sampled token's position


def decode_inputs_torch(meta, relay: torch.Tensor, block_table: torch.Tensor, block_size: int,
                        scratch_slot: int) -> DecodeInputs:
    """The reference: torch ops. Advances meta.pos by one for the valid rows."""
    valid = meta.slot >= 0
    slot = torch.where(valid, meta.slot, scratch_slot)
    positions = meta.pos.clone()
    ids = torch.where(meta.relay_src >= 0, relay[meta.relay_src.clamp(min=0)], meta.ids)
    tables = block_table[slot]
    blk = tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1).long()
    slot_mapping = torch.where(valid, blk * block_size + positions % block_size, 0)
    seq_lens = torch.where(valid, positions + 1, 0).to(torch.int32)
    samples = valid & (meta.samples > 0)
    relay_dst = torch.where(samples, slot, scratch_slot)
    meta.pos.add_(valid)
    return DecodeInputs(ids, positions, slot, slot_mapping, tables, seq_lens, samples, relay_dst, positions + 1)


def use_kernel(device: torch.device) -> bool:
    return HAS_TRITON and device.type == "cuda" and envs.decode_prep() == "on"


def decode_inputs(meta, relay: torch.Tensor, block_table: torch.Tensor, block_size: int,
                  scratch_slot: int) -> DecodeInputs:
    if use_kernel(meta.packed.device):
        return decode_inputs_kernel(meta, relay, block_table, block_size, scratch_slot)
    return decode_inputs_torch(meta, relay, block_table, block_size, scratch_slot)


# Rows of the kernel's packed int64 output, in order.
_OUT_ROWS = ("ids", "positions", "slot", "slot_mapping", "relay_dst", "next_pos")


def decode_inputs_kernel(meta, relay: torch.Tensor, block_table: torch.Tensor, block_size: int,
                         scratch_slot: int) -> DecodeInputs:
    packed = meta.packed
    assert packed.dtype == torch.int64 and packed.is_contiguous() and packed.shape[0] == meta.NUM_ROWS
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
    assert relay.dtype == torch.int64 and block_size & (block_size - 1) == 0
    b = packed.shape[1]
    width = block_table.shape[1]
    dev = packed.device
    out = torch.empty(len(_OUT_ROWS), b, dtype=torch.int64, device=dev)
    tables = torch.empty(b, width, dtype=torch.int32, device=dev)
    seq_lens = torch.empty(b, dtype=torch.int32, device=dev)
    samples = torch.empty(b, dtype=torch.bool, device=dev)
    if b:
        _decode_prep_kernel[(b,)](
            packed, relay, block_table, out, tables, seq_lens, samples,
            b, width, block_table.stride(0), scratch_slot,
            PAGE=block_size, WIDTH_P=triton.next_power_of_2(width), num_warps=1)
    rows = dict(zip(_OUT_ROWS, out))
    return DecodeInputs(rows["ids"], rows["positions"], rows["slot"], rows["slot_mapping"], tables, seq_lens,
                        samples, rows["relay_dst"], rows["next_pos"])


if HAS_TRITON:

    @triton.jit
    def _decode_prep_kernel(META, RELAY, BT, OUT, TABLES, SEQ_LENS, SAMPLES,
                            B, width, stride_bt, scratch,
                            PAGE: tl.constexpr, WIDTH_P: tl.constexpr):
        # META rows: ids, relay_src, pos, slot, samples (DecodeMeta); OUT rows: _OUT_ROWS.
        r = tl.program_id(0)
        host_id = tl.load(META + r)
        relay_src = tl.load(META + B + r)
        pos = tl.load(META + 2 * B + r)
        slot = tl.load(META + 3 * B + r)
        sampled = tl.load(META + 4 * B + r)
        valid = slot >= 0
        slot_c = tl.where(valid, slot, scratch)
        relayed = tl.load(RELAY + tl.maximum(relay_src, 0))
        table = BT + slot_c * stride_bt
        cols = tl.arange(0, WIDTH_P)
        tl.store(TABLES + r.to(tl.int64) * width + cols, tl.load(table + cols, mask=cols < width), mask=cols < width)
        blk = tl.load(table + pos // PAGE).to(tl.int64)
        samples = valid & (sampled > 0)
        tl.store(OUT + r, tl.where(relay_src >= 0, relayed, host_id))
        tl.store(OUT + B + r, pos)
        tl.store(OUT + 2 * B + r, slot_c)
        tl.store(OUT + 3 * B + r, tl.where(valid, blk * PAGE + pos % PAGE, 0))
        tl.store(OUT + 4 * B + r, tl.where(samples, slot_c, scratch))
        tl.store(OUT + 5 * B + r, pos + 1)
        tl.store(SEQ_LENS + r, tl.where(valid, pos + 1, 0).to(tl.int32))
        tl.store(SAMPLES + r, samples.to(tl.int1))
        tl.store(META + 2 * B + r, pos + valid.to(tl.int64))  # the same rows' next step
