"""Log probabilities: the vllm_model route's `logprobs` output (vllm_backend's format: per
response, a JSON list with one `{token_id: {"logprob", "rank", "decoded_token"}}` dict per new
token, the sampled token first, as vLLM orders it) -> OpenAI's two formats.

Triton's own frontend takes the lowest rank as the sampled token, which is wrong whenever the
sampled token is not the most likely one; the key order is what vLLM (and our route) define.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class Candidate:
    token_id: int
    logprob: float
    rank: Optional[int]
    text: str


@dataclass
class TokenLogprob:
    sampled: Candidate
    candidates: list[Candidate]   # every entry the route sent for this position, sampled included


def parse_route_logprobs(raw: Any) -> Optional[list[TokenLogprob]]:
    """One response's `logprobs` element (JSON text) -> one TokenLogprob per new token; None
    for vllm_backend's "null" (logprobs not requested)."""
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8")
    data = json.loads(raw) if isinstance(raw, str) else raw
    if data is None:
        return None
    out = []
    for position in data:
        cands = [Candidate(int(tid), _finite(v.get("logprob")), v.get("rank"), v.get("decoded_token") or "")
                 for tid, v in position.items()]
        if cands:
            out.append(TokenLogprob(cands[0], cands))
    return out


def _finite(x: Any) -> float:
    # OpenAI clamps -inf to -9999.0 (JSON has no infinities); vLLM does the same
    v = float(x)
    return max(v, -9999.0) if v == v else -9999.0


def _by_rank(tok: TokenLogprob, k: int) -> list[Candidate]:
    ranked = sorted((c for c in tok.candidates if c.rank is not None), key=lambda c: c.rank)
    return [c for c in ranked if c.rank <= k][:k]


def completion_logprobs(tokens: list[TokenLogprob], k: int, text_offset: int = 0) -> dict:
    """OpenAI's completions `logprobs` object for these tokens; offsets continue from
    `text_offset` (the length of the choice's text before them)."""
    offsets, pos = [], text_offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t.sampled.text)
    return {
        "tokens": [t.sampled.text for t in tokens],
        "token_logprobs": [t.sampled.logprob for t in tokens],
        "top_logprobs": [{c.text: c.logprob for c in [t.sampled] + _by_rank(t, k)} for t in tokens]
        if k > 0 else None,
        "text_offset": offsets,
    }


def _entry(c: Candidate) -> dict:
    return {"token": c.text, "logprob": c.logprob, "bytes": list(c.text.encode("utf-8"))}


def chat_logprobs(tokens: list[TokenLogprob], k: int) -> dict:
    """OpenAI's chat `logprobs` object: one content entry per token with its top-k by rank."""
    return {"content": [{**_entry(t.sampled), "top_logprobs": [_entry(c) for c in _by_rank(t, k)]}
                        for t in tokens],
            "refusal": None}
