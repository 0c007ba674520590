"""The columnar form of `/v1/predict`: `{"columns": {name: [values...]}}` into the named arrays
a v2 request's tensors become (server/v2_infer.py), so both take the same path to the model.

One list per input, the v2 tensor mapping's names (docs/SERVER.md, "The v2 protocol"): a
single-valued feature one value per example, a bag its ids flat plus `<feature>_lengths`. A
column of numbers becomes an int64 or float64 array in one numpy call (no step per example);
a column holding a string or a null is raw ids, made the v2 BYTES array (UTF-8, "" for none).
The element cap is checked before anything is converted.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from server.errors import shown_input
from server.feature_columns import NUMBER_TYPES
from server.v2_tensors import BatchTooLargeError, V2RequestError


def column_arrays(columns: Mapping[str, object], max_elements: int) -> dict[str, np.ndarray]:
    """The arrays of a columnar body's `columns`; V2RequestError naming the first bad column,
    BatchTooLargeError above `max_elements` values in all."""
    if not columns:
        raise V2RequestError("`columns` names no input")
    total = 0
    for name, values in columns.items():
        if not isinstance(values, list):
            raise V2RequestError(
                f"column {shown_input(name)!r} is a list of values, got {type(values).__name__}"
            )
        total += len(values)
    if total > max_elements:
        raise BatchTooLargeError(f"{total} values in all exceed the cap of {max_elements}")
    return {name: _array(name, values) for name, values in columns.items()}  # type: ignore[arg-type]


def _array(name: str, values: list[object]) -> np.ndarray:
    shown = shown_input(name)
    kinds = set(map(type, values))  # C-level, as server.feature_columns checks its columns
    if kinds <= NUMBER_TYPES:
        try:
            return np.asarray(values, dtype=np.float64 if float in kinds else np.int64)
        except OverflowError as exc:
            raise V2RequestError(f"column {shown!r}: an integer is out of int64 range") from exc
    encoded: list[bytes] = []
    for v in values:
        if v is None:
            encoded.append(b"")
        elif isinstance(v, str):
            try:
                encoded.append(v.encode("utf-8"))
            except UnicodeEncodeError as exc:
                raise V2RequestError(f"column {shown!r}: a raw id is not UTF-8 text") from exc
        elif type(v) is int:
            encoded.append(str(v).encode())
        else:
            raise V2RequestError(
                f"column {shown!r}: values are numbers, or raw ids (strings, integers, null); "
                f"got {type(v).__name__}"
            )
    array = np.empty(len(encoded), dtype=object)
    array[:] = encoded
    return array
