"""EngineStats' step counters: every step is async or sync, and the steps that carried prefill
chunks are counted apart (llm_prefill_steps_total; bench.serve's share of mixed steps)."""
import pytest

from engine_helpers import greedy, make_engine


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_prefill_steps_are_the_chunks_of_the_prompt(path, async_mode):
    # 40 prompt tokens in chunks of 16, 16, 8 (the last one samples the first token), then
    # four decode steps for the other four tokens.
    eng = make_engine(path, max_num_batched_tokens=16, async_token_handoff=async_mode)
    eng.add_request("a", list(range(10, 50)), greedy(5, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    st = eng.stats()
    assert st.prefill_steps_total == 3
    assert st.generation_tokens_total == 5
    steps = st.async_steps_total + st.sync_steps_total
    assert steps - st.prefill_steps_total == 4
    # a second request admitted while the first decodes: its one chunk rides in a mixed step
    eng.add_request("b", list(range(60, 70)), greedy(6, ignore_eos=True))
    eng.step()
    eng.add_request("c", list(range(80, 88)), greedy(2, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().prefill_steps_total == 5
