"""KV growth ahead at epochs (Scheduler._grow_ahead): steady decode rows open their KV blocks
on every block_size-th step only, so the steps between carry no block-table update; a
request never holds a block it cannot use, and the early blocks never come from the prefix
cache or from the room the next steps need."""
from backend_lib.kv_cache import BlockPool
from backend_lib.request import Request, SamplingParams
from backend_lib.scheduler import Scheduler

BS = 4


def _decode_loop(sched: Scheduler, steps: int):
    """Schedule and update synchronously (every row samples token 5); yield each step's
    SchedulerOutput after its update."""
    for _ in range(steps):
        out = sched.schedule()
        sched.update(out, [5] * len(out.rows))
        yield out


def _scheduler(num_blocks: int, caching: bool = False, max_len: int = 400) -> Scheduler:
    return Scheduler(8, 256, max_len, True, BlockPool(num_blocks, BS, enable_caching=caching))


def _add(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int, first: int = 10) -> Request:
    req = Request(rid, [first + i for i in range(prompt_len)],
                  SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    sched.add(req)
    return req


def test_steady_decode_grows_on_epoch_steps_only():
    sched = _scheduler(200)
    # Prompt lengths 5..8: the rows reach block boundaries on different steps.
    reqs = [_add(sched, f"r{i}", 5 + i, 60, first=10 + 20 * i) for i in range(4)]
    for out in _decode_loop(sched, 40):
        step = out.step_id
        # Past the first epoch (step BS) the rows are in phase: growth only on epoch steps.
        if step > BS and step % BS:
            assert out.grown == [], (step, out.grown)
        if step % BS == 0:
            # Every row holds the blocks for every position it computes before the next epoch.
            for r in reqs:
                assert len(r.block_ids) * BS >= r.num_computed_tokens + BS - 1, (step, r.request_id)
        for r in reqs:
            # Never more than one block beyond the positions computed so far.
            assert len(r.block_ids) * BS < r.num_computed_tokens + 2 * BS, (step, r.request_id)
    assert all(r.num_computed_tokens == len(r.prompt_token_ids) + 39 for r in reqs)


def test_epoch_entries_name_exactly_the_new_blocks():
    sched = _scheduler(200)
    reqs = [_add(sched, f"r{i}", 5 + i, 60, first=10 + 20 * i) for i in range(4)]
    table = {r.request_id: [] for r in reqs}  # what a runner writes from `grown`
    for out in _decode_loop(sched, 30):
        for req, first in out.grown:
            row = table[req.request_id]
            assert first == len(row), "an entry rewrites or skips block-table columns"
            row.extend(req.block_ids[first:])
        for r in reqs:
            assert table[r.request_id] == r.block_ids


def test_no_block_past_the_last_position():
    """A request that may compute KV up to position prompt + max_tokens - 2 never holds a
    block starting after it (the block table has no column for it at max_model_len)."""
    sched = _scheduler(200, max_len=16)
    req = _add(sched, "r", 5, 11)  # positions 0..14: 4 blocks of 4
    for _ in _decode_loop(sched, 30):
        assert len(req.block_ids) <= 4
        if req.is_finished:
            break
    assert req.is_finished and len(req.output_token_ids) == 11


def test_early_blocks_leave_the_cache_and_one_block_per_request():
    """At an epoch, early blocks come only from the never-cached free blocks beyond one per
    running request: here one such block, so one of the three candidates grows."""
    sched = _scheduler(20, caching=True)  # 19 usable blocks
    done = _add(sched, "cached", 16, 1)   # 4 full prompt blocks, cached when it finishes
    next(_decode_loop(sched, 1))
    assert done.is_finished and sched.blocks.num_cached == 4 and sched.blocks.num_evictable == 4
    # 4 + 4 + 3 blocks: 4 uncached free blocks left for 3 running requests (spare 1).
    reqs = [_add(sched, "a", 13, 20, first=100), _add(sched, "b", 13, 20, first=200), _add(sched, "c", 9, 20, first=300)]
    outs = list(_decode_loop(sched, 3))   # steps 2 (prefill), 3, 4 (an epoch)
    assert [o.step_id for o in outs] == [2, 3, 4] and outs[-1].num_tokens == 3
    # Each row was 1 position short of its last block's end (all three candidates); the first grew.
    assert [len(r.block_ids) * BS - r.num_computed_tokens for r in reqs] == [1 + BS, 1, 1]
    assert outs[-1].grown == [(reqs[0], 4)]
    assert sched.blocks.num_evictable == 4 and sched.blocks.num_free_uncached == 3
