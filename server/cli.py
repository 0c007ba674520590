"""`checknrun serve`: run the server under uvicorn.

Registered through the `checknrun.commands` entry-point group (`serve = "server.cli:register"`),
and runnable without the entry point as `python -m server.cli serve ...`.

Every flag overrides the matching `CHECKNRUN_SERVER_*` variable; flags left out keep the
environment's value. The admin token is never a flag (it would show in `ps`): it is read from
the environment variable `--admin-token-env` names (default CHECKNRUN_SERVER_ADMIN_TOKEN).
uvicorn turns SIGINT/SIGTERM into a lifespan shutdown, which stops the follow loop and closes the
bus and the store.

`serve` checks its configuration, the bus URL, the store and the model factory and request
adapter before uvicorn starts (uvicorn would turn a failure in the lifespan into a traceback and
exit status 3): a setting out of range, a bus URL that names no bus, a store directory or bucket
that does not exist, and a `MODULE:FUNCTION` that names no callable are refused there in one
line (exit 1; a server never creates a store), while a store with no version yet, or a store
or Kafka broker that cannot be reached for now, is waited on by the follow loop.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import SecretStr, ValidationError

from publisher.bus import StartAt, open_source
from publisher.cli import (
    CommandError,
    CommandParser,
    parse_command_line,
    run_command,
)
from publisher.cli_logging import configure_logging, quiet_library_loggers
from publisher.read.catalog import Catalog
from publisher.store import StoreMissingError, open_store
from schemas.errors import CheckNRunError
from server.settings import ENV_PREFIX, load_settings

log = logging.getLogger(__name__)

DEFAULT_TOKEN_ENV = f"{ENV_PREFIX}ADMIN_TOKEN"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `serve` command to the `checknrun` parser."""
    p = sub.add_parser(
        "serve",
        help="serve a model that follows committed versions (REST API)",
        description="Bootstrap the model from HEAD, follow new versions, answer predictions.",
    )
    p.add_argument("--store", help=f"file:///PATH or s3://BUCKET/PREFIX (env {ENV_PREFIX}STORE)")
    p.add_argument(
        "--bus",
        help="file:///PATH.log or kafka://HOST:PORT/TOPIC; without it, "
        f"HEAD is polled (env {ENV_PREFIX}BUS)",
    )
    p.add_argument("--model", help=f"model name (env {ENV_PREFIX}MODEL)")
    p.add_argument(
        "--model-factory",
        metavar="MODULE:FUNCTION",
        help="build the served module from each version's model_config: a model of your own "
        "(docs/SERVER.md; imported from the current directory too); default the built-in DLRM",
    )
    p.add_argument(
        "--request-adapter",
        metavar="MODULE:FUNCTION",
        help="build, from a version's model_config, the adapter turning a request's examples "
        "into the module's inputs and its output into scores (needed with --model-factory)",
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="bind port (default 8000; 0 = any free port)")
    p.add_argument(
        "--grpc-port",
        type=int,
        help="also serve the v2 inference protocol over gRPC on this port (default: REST only)",
    )
    p.add_argument(
        "--admin-token-env",
        default=DEFAULT_TOKEN_ENV,
        metavar="VAR",
        help="environment variable holding the admin bearer token "
        "(default %(default)s); only the one named counts; unset = admin endpoints disabled",
    )
    p.add_argument("--environment", choices=["development", "production"])
    p.add_argument(
        "--track",
        choices=["released", "candidate"],
        help="released (default): the versions the release gate released (every committed "
        "version while the model has no gate); candidate: every committed version as it comes",
    )
    p.add_argument(
        "--consistency",
        choices=["double-buffer", "rwlock"],
        help="version swap scheme (default double-buffer; rwlock halves memory)",
    )
    p.add_argument(
        "--quantized-tables",
        choices=["on", "off"],
        help="hold int-coded tables quantized, looked up by torch's quantized kernels "
        "(default on; off = float32 tables)",
    )
    p.add_argument("--torch-threads", type=int)
    p.add_argument(
        "--workers",
        type=int,
        help="request processes reading one copy of the model from shared memory "
        "(default 1; use the machine's cores)",
    )
    p.add_argument("--max-batch", type=int, help="examples per request (default 1024)")
    p.add_argument("--max-body-bytes", type=int, help="request body cap (default 1 MiB)")
    p.add_argument(
        "--ready-max-staleness",
        type=float,
        metavar="SECONDS",
        help="/readyz fails while a newer version has waited this long",
    )
    p.add_argument(
        "--poll-head-after",
        type=float,
        metavar="SECONDS",
        help="read HEAD after this long without announcements (default 30)",
    )
    p.add_argument("--bus-start", choices=["latest", "earliest"])
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    p.set_defaults(func=cmd_serve)


def settings_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Any:
    """ServerSettings from the environment with the flags on top; CommandError naming every
    invalid setting on one line."""
    env = os.environ if environ is None else environ
    token_value = env.get(args.admin_token_env)
    overrides: dict[str, Any] = dict(
        store=args.store,
        bus=args.bus,
        model=args.model,
        model_factory=args.model_factory,
        request_adapter=args.request_adapter,
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        environment=args.environment,
        consistency=args.consistency,
        track=args.track,
        quantized_tables=None if args.quantized_tables is None else args.quantized_tables == "on",
        torch_threads=args.torch_threads,
        workers=args.workers,
        max_batch=args.max_batch,
        max_body_bytes=args.max_body_bytes,
        ready_max_staleness_s=args.ready_max_staleness,
        poll_head_after_s=args.poll_head_after,
        bus_start=args.bus_start,
    )
    if args.admin_token_env != DEFAULT_TOKEN_ENV:
        # The default variable is read by the settings themselves; another one is read here,
        # and is then the only one that counts: unset, admin stays disabled even if the
        # default variable is set (it used to enable admin with that one).
        overrides["admin_token"] = SecretStr(token_value) if token_value else None
    try:
        return load_settings(**overrides)
    except ValidationError as exc:
        # Where and what only: pydantic's messages never hold the input, so no secret shows.
        problems = "; ".join(
            ": ".join(filter(None, (".".join(map(str, error["loc"])), error["msg"])))
            for error in exc.errors()
        )
        raise CommandError(f"invalid configuration: {problems}") from exc


def check_bus_url(bus_url: str | None, start: StartAt) -> None:
    """BusError when `bus_url` names no bus (an unknown scheme, a malformed Kafka URL).

    The source is opened and closed without connecting: a Kafka broker that cannot be reached
    is the follow loop's to wait out (HEAD polls cover the gap), like an unreachable store.
    """
    if bus_url is not None:
        open_source(bus_url, start=start).close()


def check_store_exists(store_url: str, model: str) -> None:
    """StoreMissingError when the store's directory or bucket does not exist.

    One read of HEAD (an S3 store answers a missing bucket only to a request). Anything else it
    meets (no version yet, the store unreachable, a bad HEAD) is the follow loop's to wait out,
    retry and report once serving, so it is only logged here.
    """
    with open_store(store_url, create=False) as store:
        try:
            Catalog(store, model).head()
        except StoreMissingError:
            raise
        except CheckNRunError as exc:
            log.warning("store %s: %s; serving anyway, the follow loop retries", store.url, exc)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn  # only `serve` needs it

    from server.app import create_app

    settings = settings_from_args(args)
    logging.getLogger().setLevel(args.log_level.upper())
    quiet_library_loggers()  # after the level: `--log-level debug` shows the libraries' lines
    if settings.admin_token is None:
        log.info("no admin token configured: admin endpoints disabled")
    # Here rather than in the lifespan: uvicorn would turn them into a traceback and exit 3.
    check_bus_url(settings.bus, settings.bus_start)
    check_store_exists(settings.store, settings.model)
    app = create_app(settings)  # imports --model-factory and --request-adapter (PluginError)
    if settings.workers > 1:
        from server.workers import serve_with_workers

        del app  # imported the plugins; each process builds its own
        return serve_with_workers(settings, args.log_level)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=int(settings.shutdown_timeout_s),
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m server.cli serve ...` without the `checknrun` entry point."""
    parser: argparse.ArgumentParser = CommandParser(prog="python -m server.cli")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register(sub)
    args = parse_command_line(parser, argv)
    configure_logging()
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
