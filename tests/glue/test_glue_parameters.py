"""Glue (non-engine) parameters of the llm model: values in milliseconds are checked with a
message naming the parameter."""
import pytest

from triton_glue.config import GLUE_PARAMETERS, glue_parameter, positive_ms


@pytest.mark.parametrize("raw,ms", [("0.5", 0.5), ("5", 5.0), ("1000", 1000.0)])
def test_positive_ms_accepts(raw, ms):
    assert positive_ms("gil_switch_interval_ms", raw) == ms


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "1001", "fast", ""])
def test_positive_ms_rejects_with_the_name(raw):
    with pytest.raises(ValueError, match=r"'gil_switch_interval_ms' must be a number of ms in \(0, 1000\]"):
        positive_ms("gil_switch_interval_ms", raw)


def test_switch_interval_defaults_to_python_s_own():
    assert GLUE_PARAMETERS["gil_switch_interval_ms"] == ""
    cfg = {"parameters": {"gil_switch_interval_ms": {"string_value": "0.25"}}}
    assert glue_parameter(cfg, "gil_switch_interval_ms") == "0.25"
    assert glue_parameter({"parameters": {}}, "gil_switch_interval_ms") == ""
