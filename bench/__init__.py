"""Benchmarks (printed, not asserted): `python -m bench.decode` (decode throughput vs HF generate)."""
