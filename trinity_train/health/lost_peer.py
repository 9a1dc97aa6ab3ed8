"""Which errors of a run are a lost peer (infrastructure: restart it) rather than a bug.

torch raises the `torch.distributed.DistError` family (DistBackendError, DistNetworkError,
DistStoreError) when a collective times out, a connection drops or the store is gone; gloo raises
a plain RuntimeError for the same ("Connection closed by peer", "Timed out waiting ..."), whose
message names the gloo source file it came from. Both mean another rank or its host went away
or stopped answering: running the job again is the cure (exit code 75). Read from the error's
class names and message only, so the CLI can ask without importing torch.
"""

from __future__ import annotations

GLOO_SOURCE = "/gloo/"  # gloo's messages start with "[.../third_party/gloo/gloo/transport/...]"


def is_lost_peer(error: BaseException) -> bool:
    if any(c.__name__ == "DistError" and c.__module__.startswith("torch") for c in type(error).__mro__):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and text.startswith("[") and GLOO_SOURCE in text.split("]", 1)[0]


def describe(error: BaseException) -> str:
    """One line of what torch or gloo said."""
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."
