"""TablePlan: a step's table updates packed in one int64 tensor and read back by section."""
import numpy as np
import pytest
import torch

from backend_lib.step_plan import TablePlan


def test_sections_read_back_what_was_packed():
    ints = [[3, 40, 2**62 + 5, 17, 0, -1, 9], [0, -1, 7, 250, 2, 11, -1]]
    floats = [[0.0, 0.9, 0.05, 1.2, -0.5, 0.25], [0.7, 1.0, 0.0, 1.0, 0.0, 2.0]]
    history = [[3, 3, 0], [101, 102, 103], [0, 0, 1]]
    growth = [[3, 3, 0, 5], [0, 1, 4, 2], [17, 18, 250, 9]]
    plan = TablePlan.pack(ints, floats, history, growth, width=7, num_floats=6)
    assert plan.packed.dtype == torch.int64 and plan.packed.dim() == 1
    sec = plan.sections(plan.packed.clone())  # as the device reads its copy
    assert sec.admissions.tolist() == ints
    assert sec.admission_floats.dtype == torch.float32
    assert sec.admission_floats.tolist() == np.array(floats, dtype=np.float32).tolist()
    assert sec.history.tolist() == history
    assert sec.growth.tolist() == growth
    assert sec.penalty_resets is None  # no admission with penalties
    penalized = TablePlan.pack(ints, floats, history, growth, width=7, num_floats=6, num_penalized=1)
    assert penalized.sections(penalized.packed).penalty_resets.tolist() == [3]  # the first admission's slot


def test_absent_sections_are_none():
    plan = TablePlan.pack([], [], [[], [], []], [[1, 2], [0, 1], [5, 6]], width=7, num_floats=6)
    sec = plan.sections(plan.packed)
    assert sec.admissions is None and sec.admission_floats is None and sec.history is None
    assert sec.growth.tolist() == [[1, 2], [0, 1], [5, 6]]
    plan = TablePlan.pack([[1, 2, 3]], [[0.5, 0.25]], [[], [], []], [[], [], []], width=3, num_floats=2)
    sec = plan.sections(plan.packed)
    assert sec.admissions.tolist() == [[1, 2, 3]] and sec.admission_floats.tolist() == [[0.5, 0.25]]
    assert sec.history is None and sec.growth is None


def test_an_odd_number_of_floats_is_refused():
    with pytest.raises(ValueError, match="odd"):
        TablePlan.pack([[1]], [[0.5]], [[], [], []], [[], [], []], width=1, num_floats=1)


def test_growth_entries_pack_every_new_block():
    """KV growth rows (slot, block index, block id): an entry (req, first) stands for
    req.block_ids[first:], one block (a decode row) or several (an admission, a chunk)."""
    from types import SimpleNamespace

    from backend_lib.model_runner import ModelRunner
    one = SimpleNamespace(slot=4, block_ids=[7, 8, 9])
    admitted = SimpleNamespace(slot=0, block_ids=[3, 5, 6])
    chunk = SimpleNamespace(slot=2, block_ids=[11, 12, 13, 14])
    sched = SimpleNamespace(new_slots=[], grown=[(one, 2), (admitted, 0), (chunk, 2)])
    up = ModelRunner.pack_table_updates(None, sched, ())  # growth alone reads nothing of the runner
    assert up.growth == [[4, 0, 0, 0, 2, 2], [2, 0, 1, 2, 2, 3], [9, 3, 5, 6, 13, 14]]
    assert up.ints == [] and up.history == [[], [], []]
