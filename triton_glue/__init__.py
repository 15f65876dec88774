"""Pure-Python glue between Triton's Python backend and `backend_lib`.

Nothing here imports `triton_python_backend_utils` (pb_utils): the model.py files own that
import and pass what they need in. So every piece here is unit-testable without Triton:

- launch:       where tritonserver, its Python stub and libraries live; argv/env to start it
- inputs:       typed request parsing and validation (errors name the field)
- detokenizer:  incremental, UTF-8 safe detokenization (stateful and stateless forms)
- stops:        stop-string matching on streamed text (hold back partial matches)
- vllm_compat:  vllm_backend's `sampling_parameters` JSON coercion
- venv_hint:    what to run instead when a command is started outside the project's venv
"""
