"""The one JSON parse rule of every document checknrun reads (docs/FORMAT.md).

Blob headers, manifests, HEAD, the lease and announcements are all parsed by `loads`, so they
are equally strict. Python's `json.loads` accepts things no checknrun writer produces and two
readers could disagree on; here each is refused with the caller's `FormatError` subclass:

- bytes that are not UTF-8 (a BOM included), or text that is not one JSON value;
- a duplicate key in an object (`json.loads` keeps the last, another parser the first);
- `NaN`, `Infinity` and `-Infinity` (not JSON);
- a lone surrogate escape such as `"\\ud800"` (no UTF-8 writer can produce it);
- nesting deep enough to exhaust the interpreter's recursion, and integers past its digit limit.

Callers that validate with pydantic run `loads` first as a gate and then let pydantic parse the
same bytes, so the two parsers never see different documents.
"""

from __future__ import annotations

import json
import json.scanner
import re
from collections.abc import Callable
from typing import Any, NoReturn, cast

from schemas.errors import FormatError

# A surrogate can only come from a \uD800-\uDFFF escape: strict UTF-8 refuses encoded ones. A
# valid pair (how ensure_ascii writers spell characters past U+FFFF) is joined by json.loads,
# so only when such an escape appears is the parsed value searched for a lone one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def loads(data: bytes | bytearray | memoryview | str, error: type[FormatError], what: str) -> Any:
    """The JSON value in `data`; raise `error` naming `what` if it breaks a rule above."""
    return StrictDecoder(error, what).loads(data)


class StrictDecoder:
    """The rule above as a reusable decoder, built once: `loads` per document costs the parse
    only (hot paths parse one small document per Kafka record, docs/FORMAT.md section 8)."""

    def __init__(self, error: type[FormatError], what: str) -> None:
        self.error = error
        self.what = what

        def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            obj = dict(pairs)
            if len(obj) != len(pairs):  # rare: find the key to name it
                seen: set[str] = set()
                for key, _ in pairs:
                    if key in seen:
                        raise error(f"duplicate key {key!r} in {what}, expected unique keys")
                    seen.add(key)
            return obj

        def no_constant(name: str) -> NoReturn:
            raise error(f"{name} in {what}, expected plain JSON (no NaN or Infinity)")

        self._decoder = json.JSONDecoder(object_pairs_hook=unique_keys, parse_constant=no_constant)
        # What JSONDecoder itself scans with (typeshed types the argument oddly).
        self._scan: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(
            cast(Any, self._decoder)
        )

    def loads(self, data: bytes | bytearray | memoryview | str) -> Any:
        """The JSON value in `data`; raise `self.error` if it breaks a rule above."""
        error, what = self.error, self.what
        if isinstance(data, str):
            text = data
        else:
            try:
                text = bytes(data).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise error(f"{what} is not UTF-8: {exc}") from exc
        try:
            try:
                # The scanner alone, when the value fills the text: JSONDecoder.decode adds
                # two whitespace regex matches around the same scan.
                value, end = self._scan(text, 0)
            except StopIteration:
                end = -1
            if end != len(text):  # leading or trailing whitespace, extra data, not JSON
                value = self._decoder.decode(text)
        except FormatError:
            raise
        except (ValueError, RecursionError) as exc:
            # ValueError covers JSONDecodeError and ints past the interpreter's digit limit;
            # RecursionError a deeply nested array.
            raise error(f"{what} is not JSON: {exc}") from exc
        # `in` first: a plain substring search, far cheaper than the regex on most documents.
        if "\\u" in text and _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
            raise error(f"{what} holds a lone surrogate escape: not valid Unicode")
        return value


def _has_lone_surrogate(value: object) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
