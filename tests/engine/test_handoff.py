"""TokenHandoff on CPU: each handle reads back its own step's rows, whatever the shapes that
went through the same ring buffer before (a buffer's view is kept while the shape repeats)."""
import torch

from backend_lib.handoff import TokenHandoff


def test_handles_read_their_own_rows_across_shapes():
    h = TokenHandoff(torch.device("cpu"), width=8, depth=2, max_cols=3)
    steps = [(torch.arange(8) + 100, 8),                            # a full bucket: no slice
             (torch.arange(8) + 200, 5),                            # fewer rows than the bucket
             (torch.arange(8) + 300, 8),                            # ring buffer 0 again, same shape
             (torch.arange(24).view(8, 3) + 400, 4),                # ids + logprobs: [rows, cols]
             (torch.arange(8) + 500, 8),                            # buffer 0: back to 1-D
             (torch.arange(8) + 600, 5)]                            # buffer 1: back to 1-D, 5 rows
    for sampled, n in steps:
        handle = h.publish(sampled, n)
        want = (sampled[:n, 0] if sampled.dim() == 2 else sampled[:n]).tolist()
        assert handle.get() == want
        assert handle.host_buf.shape == sampled[:n].shape and handle.host_buf.tolist() == sampled[:n].tolist()


def test_a_kept_view_is_not_read_by_a_later_handle():
    """Two handles of the same shape in flight on different ring buffers hold their own rows."""
    h = TokenHandoff(torch.device("cpu"), width=4, depth=2)
    a = h.publish(torch.tensor([1, 2, 3, 4]), 4)
    b = h.publish(torch.tensor([5, 6, 7, 8]), 4)
    assert a.get() == [1, 2, 3, 4] and b.get() == [5, 6, 7, 8]
    c = h.publish(torch.tensor([9, 10, 11, 12]), 4)  # buffer 0 again: a was consumed
    assert c.get() == [9, 10, 11, 12] and b.get() == [5, 6, 7, 8]
