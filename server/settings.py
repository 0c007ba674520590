"""The server's configuration: one pydantic-settings class, read from `CHECKNRUN_SERVER_*`.

Settings are built by `load_settings()` (never at import time), so tests build their own with
`ServerSettings(...)` and the CLI overlays its flags on the environment. The admin token is a
`SecretStr`: it never appears in a repr, a log line or the API. Outside development a token that
looks like a placeholder or is too short to resist guessing is refused at start-up.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from publisher.tunables import DEFAULT_TUNABLES
from schemas.manifest import check_model_name

ENV_PREFIX = "CHECKNRUN_SERVER_"

#: tokens too easy to guess to guard a production endpoint (compared case-insensitively).
WEAK_TOKENS = frozenset(
    {
        "changeme",
        "change-me",
        "changethis",
        "secret",
        "password",
        "admin",
        "token",
        "test",
        "default",
        "letmein",
        "checknrun",
        "0000000000000000",
        "1234567890123456",
    }
)
MIN_TOKEN_CHARS = 16

ConsistencyScheme = Literal["double-buffer", "rwlock"]


class ServerSettings(BaseSettings):
    """Everything `checknrun serve` can be told; each field is also `CHECKNRUN_SERVER_<NAME>`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        frozen=True,
        protected_namespaces=(),
        # Validation errors would otherwise echo the raw input, admin token included.
        hide_input_in_errors=True,
    )

    store: str = Field(description="store URL: file:///PATH or s3://BUCKET/PREFIX")
    bus: str | None = Field(
        default=None,
        description="announcement bus URL (file:///PATH.log or kafka://HOST:PORT/TOPIC); "
        "without one the server polls HEAD every `poll_head_after_s`",
    )
    model: str = Field(description="model name in the store")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    environment: Literal["development", "production"] = Field(
        default="production",
        description="`development` accepts weak admin tokens; never use it on a shared network",
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description="bearer token of the admin endpoints (pin, unpin, digest); none = disabled",
    )

    consistency: ConsistencyScheme = Field(
        default="double-buffer",
        description="how a version is swapped in under running predictions (server/consistency.py)",
    )
    torch_threads: int = Field(default=1, ge=1, le=256, description="torch intra-op threads")
    max_batch: int = Field(default=1024, ge=1, description="examples per predict request")
    max_body_bytes: int = Field(default=1024 * 1024, ge=1024, description="request body cap")
    max_ids_per_bag: int = Field(default=4096, ge=1, description="ids per bag feature value")
    ready_max_staleness_s: float | None = Field(
        default=None,
        gt=0,
        description="/readyz answers 503 while a newer committed version has waited this long "
        "(never while pinned); None = readiness only needs the bootstrap",
    )

    memory_budget_bytes: int | None = Field(
        default=None,
        ge=1,
        description="most bytes the served model's copies may take (checked on each new "
        "version's manifest before anything is allocated); None = 3/4 of the machine's memory",
    )
    manifest_cache_size: int = Field(
        default=DEFAULT_TUNABLES.manifest_cache_size,
        ge=1,
        description="manifests kept in memory (least recently used evicted first)",
    )

    poll_timeout_s: float = Field(default=1.0, gt=0, description="longest wait of one bus poll")
    poll_head_after_s: float = Field(
        default=30.0, gt=0, description="read HEAD after this long without announcements"
    )
    retry_initial_s: float = Field(default=1.0, gt=0, description="first retry after a failure")
    retry_max_s: float = Field(default=60.0, gt=0, description="cap of the retry backoff")
    bus_start: Literal["latest", "earliest"] = Field(
        default="latest",
        description="where a new bus subscription starts; the bootstrap reads HEAD anyway",
    )
    follow: bool = Field(default=True, description="run the follow loop (tests may turn it off)")
    shutdown_timeout_s: float = Field(default=30.0, gt=0)

    @field_validator("model")
    @classmethod
    def _model_name(cls, value: str) -> str:
        return check_model_name(value)

    @model_validator(mode="after")
    def _refuse_weak_token(self) -> ServerSettings:
        if self.admin_token is None or self.environment == "development":
            return self
        token = self.admin_token.get_secret_value()
        if token.strip().lower() in WEAK_TOKENS or len(token) < MIN_TOKEN_CHARS:
            # The message names the rule, never the token.
            raise ValueError(
                f"the admin token is a known placeholder or shorter than {MIN_TOKEN_CHARS} "
                "characters; generate one (e.g. `python -c 'import secrets; "
                "print(secrets.token_urlsafe(32))'`) or set "
                f"{ENV_PREFIX}ENVIRONMENT=development"
            )
        if len(set(token)) < 4:
            raise ValueError("the admin token repeats too few characters to be a real secret")
        return self

    @model_validator(mode="after")
    def _retry_range(self) -> ServerSettings:
        if self.retry_max_s < self.retry_initial_s:
            raise ValueError("retry_max_s must be >= retry_initial_s")
        return self

    @property
    def admin_enabled(self) -> bool:
        return self.admin_token is not None


def load_settings(**overrides: Any) -> ServerSettings:
    """Settings from the environment (`CHECKNRUN_SERVER_*`) with `overrides` on top.

    Overrides whose value is None are dropped, so CLI flags that were not given leave the
    environment's value in place.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    return ServerSettings(**given)
