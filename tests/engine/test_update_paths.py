"""Scheduler.update's two per-token paths: plain requests (Request.plain_outputs: no
min_tokens, stop sequences or logprobs) check the stop ids and the length only; the others
go through their sampling parameters. Both in one step, with the rows they emit."""
from backend_lib.kv_cache import BlockPool
from backend_lib.request import Request, SamplingParams
from backend_lib.scheduler import Scheduler


def _req(rid: str, **kw) -> Request:
    return Request(rid, [10, 11, 12], SamplingParams(max_tokens=kw.pop("max_tokens", 5), temperature=0.0, **kw))


def test_plain_outputs_is_derived_from_the_sampling_parameters():
    assert _req("a").plain_outputs
    assert _req("b", stop_token_ids=[7], ignore_eos=True).plain_outputs
    assert not _req("c", min_tokens=2).plain_outputs
    assert not _req("d", stop_sequences=[[7, 8]]).plain_outputs
    assert not _req("e", logprobs=0).plain_outputs


def test_plain_and_general_rows_in_one_step():
    sched = Scheduler(8, 256, 64, True, BlockPool(40, 4))
    reqs = {"plain": _req("plain", stop_token_ids=[7]),
            "min": _req("min", stop_token_ids=[7], min_tokens=2),
            "seq": _req("seq", stop_sequences=[[8, 7]]),
            "len": _req("len", max_tokens=2)}
    for r in reqs.values():
        sched.add(r)
    rows_by_step = []
    for tokens in ([8, 7, 8, 8], [7, 7, 7, 9]):
        out = sched.schedule()
        order = [row.request.request_id for row in out.rows]
        rows_by_step.append({row[0]: row for row in sched.update(out, [tokens[list(reqs).index(rid)] for rid in order])})
    first, second = rows_by_step
    # Step 1: every request emits its first token; "min" ignores its stop id below min_tokens.
    assert {rid: (row[1], row[2]) for rid, row in first.items()} == {
        "plain": ([8], False), "min": ([7], False), "seq": ([8], False), "len": ([8], False)}
    # Step 2: "plain" stops on its id, "min" now may, "seq" completes [8, 7], "len" hits max_tokens.
    assert {rid: (row[1], row[2], row[3], row[5]) for rid, row in second.items()} == {
        "plain": ([7], True, "stop", 2), "min": ([7], True, "stop", 2), "seq": ([7], True, "stop", 2),
        "len": ([9], True, "length", 2)}
    assert sched.stats.generation_tokens_total == 8 and not sched.running
