"""int64_pack: the struct conversions give what array / numpy give."""
from array import array

import numpy as np
import pytest

from backend_lib.int64_pack import int64_array, int64_bytes


@pytest.mark.parametrize("values", [[], [0], [1, -1, 2**63 - 1, -2**63, 151_936], list(range(1000)),
                                    (5, 6, True)])
def test_int64_conversions_match_array_and_numpy(values):
    assert int64_bytes(values) == array("q", values).tobytes()
    got = int64_array(values)
    assert got.dtype == np.int64 and got.tolist() == np.array(values, dtype=np.int64).tolist()


def test_values_outside_int64_are_refused():
    import struct
    with pytest.raises(struct.error):
        int64_bytes([2**63])
