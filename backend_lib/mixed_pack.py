"""Host side of a step that carries prefill chunks: the scheduler's rows as the per-token and
per-row arrays the mixed program reads (mixed_graphs.MixedMeta, the eager mixed step, the
pipeline stages).

Every row of such a step is packed, and while requests come and go that is most steps. Most
of its rows are decodes (one token from the relay, sampled), whose columns are constants
except slot and position, so only those two are converted for every row (struct.pack, in C);
the other rows (prefill chunks, host-known inputs) are read one by one, their ids per token
in numpy (a chunk's ids are a view of its prompt's int64 bytes, see Scheduler._add_row).
"""
from __future__ import annotations

from operator import itemgetter
from typing import NamedTuple, Optional, Sequence

import numpy as np

from .int64_pack import int64_array


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


_start_pos = itemgetter(1)  # ScheduledRow.start_pos


def pack_rows(rows: Sequence, slots: Sequence[int], irregular: Optional[Sequence[int]] = None) -> MixedRows:
    """rows: ScheduledRow (request, start_pos, num_new_tokens, samples, host_token_ids,
    first_from_relay); slots: each row's request slot (SchedulerOutput.slots); irregular:
    the indices of the rows that are not relay decodes (SchedulerOutput.irregular_rows;
    None: found here)."""
    s = len(rows)
    if s == 0:
        return MixedRows(np.zeros((4, 0), np.int64), np.zeros((4, 0), np.int64), np.zeros(1, np.int64))
    if irregular is None:
        irregular = [i for i, r in enumerate(rows) if not r.is_relay_decode]
    slot = int64_array(slots)
    start = int64_array(list(map(_start_pos, rows)))
    n = np.ones(s, dtype=np.int64)
    samples = np.ones(s, dtype=np.int64)
    from_relay = np.ones(s, dtype=bool)
    if irregular:
        odd = [rows[i] for i in irregular]
        n[irregular] = [r.num_new_tokens for r in odd]
        samples[irregular] = [r.samples for r in odd]
        from_relay[irregular] = [r.first_from_relay for r in odd]
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
    # Input ids: the host's, where it has them (a relay row's first id is a dummy 0).
    tok[0] = 0
    for i in irregular:
        r = rows[i]
        if r.num_new_tokens > 1:
            tok[0, first[i]:cu[i + 1]] = r.host_token_ids
        elif not r.first_from_relay:
            tok[0, first[i]] = r.host_token_ids[0]

    row = np.empty((4, s), dtype=np.int64)
    row[0] = slot
    np.add(start, n, out=row[1])
    np.subtract(cu[1:], 1, out=row[2])
    row[3] = samples
    return MixedRows(tok, row, cu)
