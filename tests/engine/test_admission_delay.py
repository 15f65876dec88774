"""scheduler_delay_factor (vLLM's rule, backend_lib/admission_delay.py): new prompts join the
running batch once the oldest waiting one has waited longer than factor x the latency of an
admitting step (the median of the last few), or at once when nothing runs; the outputs stay HF's."""
import random

import pytest

from backend_lib import EngineConfig
from backend_lib.admission_delay import AdmissionDelay
from backend_lib.kv_cache import BlockPool
from backend_lib.request import Request, SamplingParams
from backend_lib.scheduler import Scheduler
from engine_helpers import Spec, expected_from_reference, greedy, hf_greedy, make_engine, random_prompt, run_specs


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _scheduler(factor: float, clock: Clock) -> Scheduler:
    return Scheduler(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256, enable_chunked_prefill=True,
                     blocks=BlockPool(200, 16), delay=AdmissionDelay(factor, clock))


def _req(rid: str) -> Request:
    return Request(rid, [5, 6, 7, 8], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))


def _admitted(out) -> list[str]:
    return [r.request_id for r in out.new_slots]


def _decode(sched: Scheduler, out) -> None:
    """The step's tokens arrive (one per sampling row), as the engine's update does."""
    sched.update(out, [9] * len(out.rows))


def test_prompts_wait_for_factor_times_the_last_admitting_step():
    clock = Clock()
    s = _scheduler(2.0, clock)
    s.add(_req("a"))
    out = s.schedule()
    assert _admitted(out) == ["a"]          # nothing was running: at once
    clock.t += 0.010                         # that admitting step took 10 ms
    _decode(s, out)
    s.add(_req("b"))
    out = s.schedule()                       # measures the admitting step: latency 10 ms
    assert s.delay.prompt_latency == pytest.approx(0.010)
    assert _admitted(out) == []              # b waited 0 ms of the 20 ms
    for waited_ms in (5, 12, 19):
        clock.t += 0.005 if waited_ms == 5 else 0.007
        _decode(s, out)
        if waited_ms == 12:
            s.add(_req("c"))                 # joins the same admission as b
        out = s.schedule()
        assert _admitted(out) == [], waited_ms
    clock.t += 0.0015                        # b has waited 20.5 ms > 2 x 10 ms
    _decode(s, out)
    out = s.schedule()
    assert _admitted(out) == ["b", "c"]
    assert [r.request.request_id for r in out.rows][-2:] == ["b", "c"] and s.num_waiting == 0


def test_one_slow_admitting_step_does_not_hold_prompts_back():
    """A first-use graph capture made the last admitting step take 2 s: with factor 4, vLLM's
    rule (the last latency) would hold the next prompt 8 s; the median of the last few keeps
    the delay at the usual steps' scale."""
    clock = Clock()
    d = AdmissionDelay(4.0, clock)
    for took in (0.010, 0.010, 0.010, 2.0):   # four admitting steps, the last one slow
        d.may_admit([], True)
        d.admitted()
        clock.t += took
    waiting = [_req("p")]
    waiting[0].arrival_time = clock.t
    assert not d.may_admit(waiting, True)      # measures the slow one; the prompt just came
    assert d.prompt_latency == pytest.approx(0.010)
    clock.t += 0.030
    assert not d.may_admit(waiting, True)      # 30 ms < 4 x 10 ms
    clock.t += 0.015
    assert d.may_admit(waiting, True)          # 45 ms


def test_factor_zero_admits_every_step_and_an_idle_engine_admits_at_once():
    clock = Clock()
    s = _scheduler(0.0, clock)
    s.add(_req("a"))
    out = s.schedule()
    _decode(s, out)
    s.add(_req("b"))
    assert _admitted(s.schedule()) == ["b"]
    idle = _scheduler(50.0, clock)
    idle.add(_req("x"))
    out = idle.schedule()
    assert _admitted(out) == ["x"]
    clock.t += 1.0
    idle.abort("x")
    idle.take_finished()
    idle.add(_req("y"))
    assert _admitted(idle.schedule()) == ["y"]   # nothing running: no delay, whatever the factor


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), 101.0, True, "2"])
def test_the_factor_is_validated(path, bad):
    with pytest.raises(ValueError, match=r"EngineConfig.scheduler_delay_factor: must be a number in \[0, 100\]"):
        EngineConfig(model_path=str(path), scheduler_delay_factor=bad)


def test_from_parameters_reads_the_factor(path):
    cfg = EngineConfig.from_parameters({"model_path": str(path), "scheduler_delay_factor": {"string_value": "1.5"}})
    assert cfg.scheduler_delay_factor == 1.5


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_outputs_with_a_delay_are_hfs(path, async_mode):
    """Requests arriving over many steps while others decode, held back (a clock of one unit a
    step, factor 3: a prompt waits about three steps with free slots): each one's tokens are
    still HF's greedy continuation, and every request finishes."""
    eng = make_engine(path, max_num_seqs=6, async_token_handoff=async_mode, scheduler_delay_factor=3.0)
    clock = Clock()
    eng.scheduler.delay.clock = clock
    rng = random.Random(7)
    specs = [Spec(f"r{i}", random_prompt(rng, 5 + 3 * i), greedy(12 + i, ignore_eos=True), arrival=2 * i)
             for i in range(10)]
    held = []

    def on_step(engine, step):
        clock.t += 1.0
        sch = engine.scheduler
        if sch.num_waiting and 0 < sch.num_running < 6:
            held.append(step)

    info = run_specs(eng, specs, on_step=on_step)
    for sp in specs:
        exp, reason = expected_from_reference(hf_greedy(path, sp.prompt, sp.params.max_tokens), sp.params)
        res = info.results[sp.rid]
        assert (res.tokens, res.finish_reason) == (exp, reason), sp.rid
    assert len(held) >= 10 and eng.scheduler.delay.prompt_latency >= 1.0
