"""The server's configuration: one pydantic-settings class, read from `CHECKNRUN_SERVER_*`.

Settings are built by `load_settings()` (never at import time), so tests build their own with
`ServerSettings(...)` and the CLI overlays its flags on the environment. The admin token is a
`SecretStr`: it never appears in a repr, a log line or the API. Outside development a token that
looks like a placeholder or is too easy to guess (`token_weakness`) is refused at start-up.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from publisher.read.scheme_names import ConsistencyScheme
from publisher.read.tracks import Track
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
#: distinct characters a token needs (16 random hex digits have fewer than 6 with p = 3e-5).
MIN_TOKEN_DISTINCT_CHARS = 6
#: bits a token's character frequencies must carry (length x Shannon entropy per character):
#: 16 random hex digits carry at least 40 in all but 0.2% of draws and never below 32 in 200k;
#: `aaaaaaaaaaaaaaabcdef` carries 28.
MIN_TOKEN_FREQUENCY_BITS = 32.0


def token_weakness(token: str) -> str | None:
    """Why `token` is too easy to guess to guard an admin endpoint, or None if it is not.

    Rules: a known placeholder, fewer than MIN_TOKEN_CHARS characters, a repeated pattern (the
    steps between neighbouring characters repeat with a period of at most half the token: this
    catches `abcdabcdabcdabcd`, `aaaaaaaaaaaaaaaa` and runs like `abcdefghijklmnop`), fewer than
    MIN_TOKEN_DISTINCT_CHARS distinct characters, or character frequencies carrying fewer than
    MIN_TOKEN_FREQUENCY_BITS bits. A rule, never the token, is what the message names.
    """
    if token.strip().lower() in WEAK_TOKENS:
        return "it is a known placeholder"
    if len(token) < MIN_TOKEN_CHARS:
        return f"it is shorter than {MIN_TOKEN_CHARS} characters"
    steps = [ord(b) - ord(a) for a, b in itertools.pairwise(token)]
    if any(steps[p:] == steps[:-p] for p in range(1, len(steps) // 2 + 1)):
        return "it repeats a pattern"
    counts = Counter(token)
    if len(counts) < MIN_TOKEN_DISTINCT_CHARS:
        return f"it has fewer than {MIN_TOKEN_DISTINCT_CHARS} distinct characters"
    bits = -sum(c * math.log2(c / len(token)) for c in counts.values())
    if bits < MIN_TOKEN_FREQUENCY_BITS:
        return "a few characters make up most of it"
    return None


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
    grpc_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="also serve the v2 protocol over gRPC on this port (0: any free port); "
        "None: REST only",
    )
    environment: Literal["development", "production"] = Field(
        default="production",
        description="`development` accepts weak admin tokens; never use it on a shared network",
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description="bearer token of the admin endpoints (pin, unpin, digest); none = disabled",
    )

    model_factory: str | None = Field(
        default=None,
        description="MODULE:FUNCTION building the served module from a version's model_config "
        "(a model of your own, docs/SERVER.md); None = the built-in DLRM "
        "(publisher.dlrm:build_served_model)",
    )
    request_adapter: str | None = Field(
        default=None,
        description="MODULE:FUNCTION building, from a version's model_config, the adapter that "
        "turns a request's examples into the module's inputs and its output into scores "
        "(needed with model_factory; None = the built-in DLRM's request format)",
    )
    track: Track = Field(
        default="released",
        description="which versions to serve: `released`, the version the release gate (or a "
        "person) released (HEAD's while the model has no gate); `candidate`, every committed "
        "version as it comes (docs/RELEASE.md)",
    )
    consistency: ConsistencyScheme = Field(
        default="double-buffer",
        description="how a version is swapped in under running predictions (server/consistency.py)",
    )
    quantized_tables: bool = Field(
        default=True,
        description="hold each table whose versions arrive int8/int4/int2 in FBGEMM's fused "
        "rowwise format, looked up by torch's quantized embedding-bag kernels and written by "
        "copying rows (server/held_tables.py); off = every table float32",
    )
    torch_threads: int = Field(default=1, ge=1, le=256, description="torch intra-op threads")
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="request processes sharing one copy of the model in shared memory "
        "(server/workers/): 1 is this process alone",
    )
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
    min_reconcile_interval_s: float = Field(
        default=1.0,
        ge=0,
        description="announcements with a gap reconcile from the store at most once per this "
        "long; more within it wait for one reconcile at its end (0 = no limit)",
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
        weakness = token_weakness(self.admin_token.get_secret_value())
        if weakness is not None:
            raise ValueError(
                f"the admin token is too easy to guess: {weakness}; generate one (e.g. "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`) or set "
                f"{ENV_PREFIX}ENVIRONMENT=development"
            )
        return self

    @model_validator(mode="after")
    def _adapter_with_factory(self) -> ServerSettings:
        if self.model_factory is not None and self.request_adapter is None:
            raise ValueError(
                "a model factory needs a request adapter (request_adapter, "
                "--request-adapter MODULE:FUNCTION): the server cannot guess a model's inputs"
            )
        return self

    @model_validator(mode="after")
    def _workers_share_a_double_buffer(self) -> ServerSettings:
        if self.workers > 1 and self.consistency != "double-buffer":
            raise ValueError(
                "workers > 1 share the double buffer's two copies; the rwlock scheme would "
                "make every worker wait for each write (use consistency double-buffer)"
            )
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
    environment's value in place; except `admin_token`, given only to say where the token
    comes from (another variable than CHECKNRUN_SERVER_ADMIN_TOKEN): None then means no token,
    whatever CHECKNRUN_SERVER_ADMIN_TOKEN holds.
    """
    given = {k: v for k, v in overrides.items() if v is not None or k == "admin_token"}
    return ServerSettings(**given)
