"""Host side of a step that carries prefill chunks: the scheduler's rows as the per-token and
per-row arrays the mixed program reads (mixed_graphs.MixedMeta, the eager mixed step, the
pipeline stages).

Every row of such a step is packed, and while requests come and go that is most steps, so
the work is per row only where it must read a row (one transpose of the row tuples in C); per token it is numpy (a 256-token chunk is a slice of its prompt, not 256 Python
appends).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np


class MixedRows(NamedTuple):
    """One mixed step, packed (int64 numpy arrays; T tokens in S rows)."""
    tok: np.ndarray   # [4, T]: input id (host-known), relay_src (slot, or -1: use the id), position, KV slot
    row: np.ndarray   # [4, S]: slot, seq_len after the step, index of the last token, samples (1/0)
    cu: np.ndarray    # [S + 1]: cu_seqlens_q

    @property
    def num_tokens(self) -> int:
        return self.tok.shape[1]

    @property
    def seq_lens(self) -> list[int]:
        return self.row[1].tolist()

    @property
    def q_lens(self) -> list[int]:
        return np.diff(self.cu).tolist()


def pack_rows(rows: Sequence, slots: Sequence[int]) -> MixedRows:
    """rows: ScheduledRow (request, start_pos, num_new_tokens, samples, host_token_ids,
    first_from_relay); slots: each row's request slot (SchedulerOutput.slots)."""
    s = len(rows)
    if s == 0:
        return MixedRows(np.zeros((4, 0), np.int64), np.zeros((4, 0), np.int64), np.zeros(1, np.int64))
    _, start, n, samples, host_ids, from_relay = zip(*rows)  # columns, transposed in C
    slot = np.array(slots, dtype=np.int64)
    start = np.array(start, dtype=np.int64)
    n = np.array(n, dtype=np.int64)
    from_relay = np.array(from_relay, dtype=bool)
    cu = np.zeros(s + 1, dtype=np.int64)
    np.cumsum(n, out=cu[1:])
    first = cu[:-1]
    t = int(cu[-1])

    tok = np.empty((4, t), dtype=np.int64)
    if t == s:  # one token a row: the token arrays are the row arrays
        tok[2] = start
        tok[3] = slot
    else:
        row_of = np.repeat(np.arange(s), n)
        np.add(start[row_of], np.arange(t) - first[row_of], out=tok[2])    # positions
        tok[3] = slot[row_of]
    tok[1] = -1
    tok[1, first[from_relay]] = slot[from_relay]   # only a row's first token comes from the relay
    # Input ids: the host's, where it has them (a relay row's first id is a dummy 0). A step
    # mixes many one-token relay rows (decodes) with a few chunks, so only those rows are read.
    tok[0] = 0
    singles = np.flatnonzero(~from_relay & (n == 1))
    if len(singles):
        tok[0, first[singles]] = [host_ids[i][0] for i in singles.tolist()]
    for i in np.flatnonzero(n > 1).tolist():
        tok[0, first[i]:cu[i + 1]] = host_ids[i]

    row = np.empty((4, s), dtype=np.int64)
    row[0] = slot
    np.add(start, n, out=row[1])
    np.subtract(cu[1:], 1, out=row[2])
    row[3] = samples
    return MixedRows(tok, row, cu)
