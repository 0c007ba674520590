"""The names of the consistency schemes (publisher/read/consistency.py holds the schemes).

Apart from the schemes so that what only names one (the server's settings, `checknrun serve`'s
command line) imports neither the schemes nor the torch they stand on.
"""

from __future__ import annotations

from typing import Literal

#: how a new version replaces the served one (publisher/read/consistency.py's docstring).
ConsistencyScheme = Literal["double-buffer", "rwlock"]
SCHEMES: tuple[ConsistencyScheme, ...] = ("double-buffer", "rwlock")
