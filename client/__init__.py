"""Clients for the Triton model repository: a streaming CLI (`python -m client.generate`) and
perf_analyzer input data (perf_data_*.json)."""
