"""How text a client sent appears in an error response. (What can go wrong between the store and
a served version is the read side's: publisher/read/errors.py.)"""

from __future__ import annotations

#: characters of one client-supplied string shown in an error response.
SHOWN_INPUT_CHARS = 64


def shown_input(text: str, limit: int = SHOWN_INPUT_CHARS) -> str:
    """`text` from a request as an error response may show it: at most `limit` characters, and
    encodable as UTF-8 (a lone surrogate, which JSON escapes can carry, becomes the literal text
    `\\ud800`; left as it is, rendering the response raised and the client got a 500)."""
    cut = text if len(text) <= limit else text[:limit] + "..."
    return cut.encode("utf-8", "backslashreplace").decode("utf-8")
