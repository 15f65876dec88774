"""The messages between EngineProcessClient (the Triton model's process) and the engine core
process (backend_lib.engine_core), over one socketpair with multiprocessing.connection framing
(length-prefixed pickles: the standard library, no dependency to carry to the GPU machine).

Parent -> core: a list of commands per message.
Core -> parent: one message per write, holding every step finished since the last write: a
    step is a list of output tuples, the whole batch of one engine step (not one message per
    request). Control replies (stats, death, stop) ride the same ordered channel, so a reply
    never overtakes the outputs of the steps before it.

Outputs cross as the rows the engine makes them in (request.OUTPUT_FIELDS: plain tuples, whose
pickle costs a fraction of a dataclass instance's); the parent rebuilds RequestOutput only for
callbacks.
"""
from __future__ import annotations

from typing import Optional


# ---- parent -> core commands (tuples, first item the kind) ----------------------------------
START = "start"      # (START, EngineConfig, fault_after_steps): the first message, once
ADD = "add"          # (ADD, request_id, prompt ids, SamplingParams[, key]): key, the caller's
                     # name for the request (a Triton request id) that ABORT_KEY can use
ABORT = "abort"      # (ABORT, request_id)
ABORT_KEY = "abort_key"  # (ABORT_KEY, key): abort the requests added under key by ANY client
                         # (the model instances sharing a core: a cancel by Triton request id
                         # lands on any instance, not always the one that added the request)
STATS = "stats"      # (STATS, seq): reply (STATS, seq, EngineStats)
UNASKED_STATS = -1   # the seq of the stats the core sends each client as its loop dies (before DIED)
STOP = "stop"        # (STOP,): abort everything, deliver the finals, reply (STOPPED,), exit

# ---- core -> parent messages ------------------------------------------------------------------
READY = "ready"            # (READY, {"vocab_size", "max_model_len", "eos_token_ids", "pid"})
STARTUP_ERROR = "startup"  # (STARTUP_ERROR, exception type name, message, traceback text)
STEPS = "steps"            # (STEPS, [step, ...]); step = [output row, ...]
DIED = "died"              # (DIED, repr(exception)): the engine loop raised; the core exits
STOPPED = "stopped"        # (STOPPED,): every request got its final output; the core exits

# Exception types a start-up error is re-raised as in the parent (the model load reports the
# same type and message as the in-process engine); any other type becomes RuntimeError naming it.
_REBUILT = {t.__name__: t for t in (ValueError, TypeError, KeyError, RuntimeError, OSError, FileNotFoundError,
                                    NotADirectoryError, PermissionError, TimeoutError, ImportError,
                                    ModuleNotFoundError, NotImplementedError, MemoryError)}


def rebuild_startup_error(type_name: str, message: str) -> BaseException:
    cls: Optional[type] = _REBUILT.get(type_name)
    if cls is None:
        return RuntimeError(f"{type_name}: {message}")
    return cls(message)


class EngineCoreError(RuntimeError):
    """The engine core process failed; repr() is the child's repr of its exception (so the
    messages built from it, "engine failed: ...", read as the in-process engine's do)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __repr__(self) -> str:
        return self.text
