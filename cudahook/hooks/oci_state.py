"""The container state a runtime hands every OCI hook on stdin.

Only what cudahook uses is checked (`id`, `bundle`; the hook checks `pid`):
a detail of the runtime-spec schema it does not use must never stop a
container from starting.
"""

from __future__ import annotations

import json

from cudahook.platform.errors import UsageError

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


MAX_STATE = 1 << 20


def read_state(text: str) -> dict[str, Any]:
    """Parse the state; cheap structural checks only (the fast path)."""
    if len(text) > MAX_STATE:
        raise UsageError("container state on stdin is too large")
    try:
        state = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"container state on stdin is not JSON: {exc.msg}") from exc
    except RecursionError:
        # Deeply nested input fits in MAX_STATE but overflows the decoder.
        raise UsageError("container state on stdin is not JSON: nested too deeply") from None
    if not isinstance(state, dict):
        raise UsageError("container state on stdin is not a JSON object")
    for key in ("id", "bundle"):
        if not isinstance(state.get(key), str) or not state[key]:
            raise UsageError(f"container state has no {key!r}")
        if "\0" in state[key]:  # no path or id holds one; os calls would refuse it
            raise UsageError(f"container state: {key} holds a NUL character")
    return state
