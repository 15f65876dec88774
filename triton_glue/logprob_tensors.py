"""Log probabilities between the engine, the token-level `llm` model and the text routes.

The engine gives, per generated token, a dict {sampled id: logprob, top id: logprob, ...}
(backend_lib RequestOutput.new_logprobs: the sampled token first, then the top-N best first,
the sampled one not repeated; raw logprobs, vLLM V1's default). `llm` sends them as tensors:
  - `output_log_probs` FP32 [1, beams=1, T]: the sampled tokens' logprobs (TensorRT-LLM's);
  - `cum_log_probs` FP32 [1, beams=1]: the sequence's cumulative logprob so far (TensorRT-LLM's);
  - ours, with `num_top_logprobs` = N: `top_logprob_ids` INT32 [1, T, N] and `top_logprobs`
    FP32 [1, T, N] (best first; padded with -1 / -inf when the vocabulary is smaller than N),
    `output_log_prob_ranks` INT32 [1, T]: each sampled token's rank (1 = the likeliest).
The rank needs the top of the distribution, so `llm` asks the engine for the top
RANK_WINDOW whatever N is: exact while the sampled token is among them (vLLM counts the tokens
whose logprob is >= the sampled one's, so do we), RANK_WINDOW + 1 (a lower bound) beyond.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

RANK_WINDOW = 20  # backend_lib.layers.logprobs.MAX_LOGPROBS (the engine computes that many per row)


def sampled_logprobs(tokens: Sequence[int], dicts: Sequence[dict]) -> np.ndarray:
    """[1, 1, T] float32: each token's own logprob."""
    return np.asarray([d[t] for t, d in zip(tokens, dicts)], dtype=np.float32).reshape(1, 1, -1)


def _ranked(token: int, d: dict) -> tuple[list[tuple[int, float]], int]:
    """The entries best first (the sampled token in its place when it is among the top) and
    the sampled token's rank."""
    lp = d[token]
    others = [(t, v) for t, v in d.items() if t != token]
    in_top = len(d) <= RANK_WINDOW  # RANK_WINDOW + 1 entries: the sampled token is not a top one
    if not in_top:
        return others, RANK_WINDOW + 1
    entries = sorted(others + [(token, lp)], key=lambda e: -e[1])
    return entries, sum(1 for _, v in entries if v >= lp)


def top_logprobs(tokens: Sequence[int], dicts: Sequence[dict], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids [1, T, n] int32, logprobs [1, T, n] float32, ranks [1, T] int32)."""
    ids = np.full((len(tokens), n), -1, dtype=np.int32)
    vals = np.full((len(tokens), n), -np.inf, dtype=np.float32)
    ranks = np.zeros(len(tokens), dtype=np.int32)
    for i, (t, d) in enumerate(zip(tokens, dicts)):
        entries, ranks[i] = _ranked(t, d)
        for j, (tid, v) in enumerate(entries[:n]):
            ids[i, j], vals[i, j] = tid, v
    return ids.reshape(1, len(tokens), n), vals.reshape(1, len(tokens), n), ranks.reshape(1, -1)


def vllm_logprobs(tokens: Sequence[int], sampled: Sequence[float], ranks: Sequence[int],
                  top_ids: np.ndarray, top_vals: np.ndarray, decode: Callable[[int], str]) -> list[dict]:
    """vllm_backend's `logprobs` entries (its src/utils/request.py over vLLM's Logprob): one dict
    per token, {token id: {"logprob", "rank", "decoded_token"}}, the sampled token first, then
    the top-N (top_ids/top_vals [T, N], -1 padded) with ranks 1..N."""
    out = []
    for i, t in enumerate(tokens):
        d = {int(t): {"logprob": float(sampled[i]), "rank": int(ranks[i]), "decoded_token": decode(int(t))}}
        for j, (tid, v) in enumerate(zip(top_ids[i] if i < len(top_ids) else [], top_vals[i] if i < len(top_vals) else [])):
            if tid < 0:
                break
            d.setdefault(int(tid), {"logprob": float(v), "rank": j + 1, "decoded_token": decode(int(tid))})
        out.append(d)
    return out


def vllm_logprobs_json(entries: Optional[list[dict]]) -> bytes:
    """One sequence's `logprobs` element: JSON of the entries, or "null" when the request asked
    for none (vllm_backend's wording for SamplingParams.logprobs = None)."""
    return b"null" if entries is None else json.dumps(entries).encode("utf-8")


@dataclass
class Logprobs:
    """The logprobs of some consecutive tokens of one sequence, as a text route receives them
    from `llm` (top_ids/top_vals empty when no top-N was asked for)."""
    token_ids: list[int] = field(default_factory=list)
    sampled: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_vals: list[list[float]] = field(default_factory=list)
    cumulative: Optional[float] = None  # of the sequence so far; None: not reported yet

    @classmethod
    def from_outputs(cls, tokens: Sequence[int], get: Callable[[str], Optional[np.ndarray]]) -> "Logprobs":
        """From one `llm` response's tensors (get(name): the array, or None when absent)."""
        def rows(name: str, dtype) -> np.ndarray:
            a = get(name)
            if a is None or not tokens:
                return np.zeros((len(tokens), 0), dtype)
            return np.asarray(a).reshape(len(tokens), -1)

        sampled = get("output_log_probs")
        cum = get("cum_log_probs")
        ranks = get("output_log_prob_ranks")
        return cls(list(tokens),
                   [] if sampled is None else np.asarray(sampled, np.float64).reshape(-1).tolist(),
                   [] if ranks is None else np.asarray(ranks).reshape(-1).tolist(),
                   rows("top_logprob_ids", np.int32).tolist(), rows("top_logprobs", np.float32).tolist(),
                   None if cum is None or np.asarray(cum).size == 0 else float(np.asarray(cum).reshape(-1)[0]))

    def extend(self, other: "Logprobs") -> None:
        self.token_ids += other.token_ids
        self.sampled += other.sampled
        self.ranks += other.ranks
        self.top_ids += other.top_ids
        self.top_vals += other.top_vals
        if other.cumulative is not None:
            self.cumulative = other.cumulative

    def vllm_entries(self, decode: Callable[[int], str]) -> list[dict]:
        return vllm_logprobs(self.token_ids, self.sampled, self.ranks, self.top_ids, self.top_vals, decode)
