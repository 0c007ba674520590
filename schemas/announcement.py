"""The announcement of a committed version (docs/FORMAT.md section 6).

A small UTF-8 JSON message (MUST be at most `MAX_ANNOUNCEMENT_BYTES`, parsed by the JSON rule of
every document, schemas/strict_json.py) sent once HEAD has moved.
It is a hint, never trusted on its own: a subscriber reads the manifest it names and verifies the
blobs. Rules (MUST): schema_version 1; a valid model name; `manifest_key` under
`model + "/manifests/"` ending in `.json`; `parent < version` when set; `total_bytes >= 0`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from schemas import strict_json
from schemas.errors import AnnouncementError, ManifestError
from schemas.manifest import Manifest, check_model_name, parse_created_at
from schemas.store_keys import check_key, is_manifest_key

MAX_ANNOUNCEMENT_BYTES = 4096


class Announcement(BaseModel):
    """A committed version, as told to subscribers."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    schema_version: Literal[1] = 1
    model: str
    version: int = Field(ge=1)
    parent: int | None
    kind: Literal["full", "delta"]
    manifest_key: str
    created_at: datetime
    total_bytes: int = Field(ge=0)
    #: "released": RELEASED moved to this version (docs/FORMAT.md 9.1), not a commit; written
    #: only then, so a commit's announcement is what it was before the field existed.
    track: Literal["head", "released"] = "head"

    @field_validator("created_at", mode="before")
    @classmethod
    def _created(cls, value: object) -> object:
        return parse_created_at(value)

    @model_validator(mode="after")
    def _consistent(self) -> Announcement:
        try:
            check_model_name(self.model)
            check_key(self.model, self.manifest_key)
        except ManifestError as exc:
            raise ValueError(str(exc)) from exc
        if not is_manifest_key(self.model, self.manifest_key):
            raise ValueError(f"manifest_key {self.manifest_key!r} is not a manifest key")
        if self.parent is not None and self.parent >= self.version:
            raise ValueError(f"parent {self.parent} must be < version {self.version}")
        return self

    @classmethod
    def of(cls, manifest: Manifest, manifest_key: str) -> Announcement:
        """The announcement of a committed manifest."""
        return cls(
            model=manifest.model,
            version=manifest.version,
            parent=manifest.parent,
            kind=manifest.kind,
            manifest_key=manifest_key,
            created_at=manifest.created_at,
            total_bytes=manifest.total_bytes,
        )

    @classmethod
    def of_release(cls, manifest: Manifest, manifest_key: str) -> Announcement:
        """The announcement that RELEASED moved to a committed manifest."""
        return cls.of(manifest, manifest_key).model_copy(update={"track": "released"})

    def to_json(self) -> bytes:
        """The wire bytes."""
        data = self.model_dump_json(exclude={"track"} if self.track == "head" else None).encode()
        if len(data) > MAX_ANNOUNCEMENT_BYTES:
            raise AnnouncementError(f"announcement is {len(data)} bytes; the cap is 4096")
        return data

    @classmethod
    def from_json(cls, data: bytes) -> Announcement:
        """Parse and validate wire bytes; raise AnnouncementError on anything wrong."""
        if len(data) > MAX_ANNOUNCEMENT_BYTES:
            raise AnnouncementError(
                f"announcement is {len(data)} bytes; the cap is {MAX_ANNOUNCEMENT_BYTES}"
            )
        strict_json.loads(data, AnnouncementError, "announcement")
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise AnnouncementError(f"invalid announcement: {exc}") from exc
