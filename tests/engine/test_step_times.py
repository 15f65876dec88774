"""EngineStats' host time by phase (schedule / submit / update) and the engine thread's CPU
time: the parts of step()'s host time (its time less the waits on step tokens), each counted
once, in async and sync mode, with admissions, prefill chunks and finishes among the steps."""
import time

import pytest

from engine_helpers import greedy, make_engine


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_host_phases_are_parts_of_the_host_time(path, async_mode):
    eng = make_engine(path, async_token_handoff=async_mode, max_num_batched_tokens=32)
    s0 = eng.stats()
    assert (s0.schedule_time_s, s0.submit_time_s, s0.update_time_s, s0.host_cpu_time_s) == (0.0, 0.0, 0.0, 0.0)
    cpu0 = time.thread_time()
    outs = eng.generate([[5, 6, 7] * 20, [9, 8], [11] * 45], greedy(12, ignore_eos=True))
    thread_cpu = time.thread_time() - cpu0
    assert [len(o.token_ids) for o in outs] == [12, 12, 12]
    st = eng.stats()
    host = st.step_time_s - st.wait_time_s
    phases = [st.schedule_time_s, st.submit_time_s, st.update_time_s]
    assert min(phases) > 0 and sum(phases) <= host, (phases, host)
    # CPU time is the thread's own (generate runs step() on this thread): within the host
    # time (the two clocks tick separately: 1 ms of slack) and within what this thread used
    assert 0 < st.host_cpu_time_s <= host + 1e-3 and st.host_cpu_time_s <= thread_cpu + 1e-3
