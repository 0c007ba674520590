"""The `checknrun` command line.

Store commands (`ls`, `inspect`, `restore`) live here. `train`, `serve` and `demo` belong to the
trainer and server packages; they plug in through the `checknrun.commands` entry-point group, so
this module never imports them (imports flow one way: trainer and server stand on publisher),
and a command line loads only the plugin whose command it names (`build_parser`).

Every command with `--json` prints one JSON document on stdout and nothing else. A failure is
one line on stderr naming its cause, the exit status `exit_status` gives it, and with `--json`
the error document `{"error": {"type": ..., "message": ..., "exit_status": ...}}` on stdout.
Every command, built in or plugged in, runs through `run_command` (and its arguments through
`parse_command_line`), so all of them report failures the same way.
The store commands here open the store read-only (`open_store(url, create=False)`): they never
create anything, and a missing directory, bucket or model is an error (exit 1).
A manifest on HEAD's chain that cannot be read is not a failure of `ls` or `gc`: they name it
(in their report and in a warning on stderr) and exit 0 (`cmd_ls`, `cmd_gc` say why).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, NoReturn

from publisher.cli_logging import configure_logging
from publisher.read.catalog import Catalog, CatalogError, UnreadableManifest, VersionRef
from publisher.release.log import ReleaseLog
from publisher.release.status import VersionRelease, release_statuses
from publisher.store import open_store
from schemas.errors import BadDataError, CheckNRunError, UnavailableError
from schemas.manifest import IDS_HELD_METRIC, Manifest, ServedLoss, TableEntry, ratio_to_full_fp32

DEFAULT_STORE = "file://./checknrun-store"
#: a table's per-row optimizer columns in a `restore` file: `<table>.__optimizer_rows__`.
OPTIMIZER_ROWS = "__optimizer_rows__"

#: exit statuses: 1 = bad input or state, 2 = usage, 3 = a service unreachable, 130 = Ctrl-C.
EXIT_ERROR, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_INTERRUPTED = 1, 2, 3, 130

#: What a command may fail with and report in one line: checknrun's own errors, a local file
#: that cannot be read or written (OSError), and input that exhausts memory or the recursion
#: limit. Anything else (ValueError, TypeError, KeyError... raised by our own code) is a bug.
REPORTED = (CheckNRunError, OSError, MemoryError, RecursionError)


class CommandError(BadDataError):
    """A command failed in a way the user can fix; the message says how."""


class UsageError(CommandError):
    """The command line itself is wrong (what argparse refuses): exit status 2."""


def exit_status(exc: BaseException) -> int:
    """The exit status of a command that failed with `exc` (one of `REPORTED`, or Ctrl-C).

    3 when a service could not be reached (retrying later may work), 2 for a bad command line,
    130 when interrupted, else 1: bad input or state, a conflict with another writer, a local
    file that cannot be read or written, or input too large or too deeply nested to handle.
    """
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, UsageError):
        return EXIT_USAGE
    return EXIT_UNAVAILABLE if isinstance(exc, UnavailableError) else EXIT_ERROR


def error_message(exc: BaseException) -> str:
    """What went wrong, on one line (multi-line messages, such as pydantic's, are joined)."""
    if isinstance(exc, KeyboardInterrupt):
        text = "interrupted"
    elif isinstance(exc, MemoryError):
        text = f"out of memory: {exc}" if str(exc) else "out of memory"
    elif isinstance(exc, RecursionError):
        text = f"input nested too deeply to handle: {exc}"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def report_failure(prog: str, exc: BaseException, *, as_json: bool) -> int:
    """Print `exc` as one line on stderr (and the JSON error document on stdout when `as_json`);
    returns its exit status."""
    code = exit_status(exc)
    message = error_message(exc)
    reason = "unavailable: " if code == EXIT_UNAVAILABLE else ""
    print(f"{prog}: {reason}{message}", file=sys.stderr)
    if as_json:
        error = {"type": type(exc).__name__, "message": message, "exit_status": code}
        print(json.dumps({"error": error}))
    return code


def run_command(args: argparse.Namespace) -> int:
    """Run `args.func(args)` and return its exit status.

    A failure in `REPORTED` (or Ctrl-C) becomes `report_failure`'s line and exit status; anything
    else is a bug and propagates with its traceback.
    """
    # Some commands (bench) take `--json OUT`, a file name: only `--json` alone means stdout.
    as_json = getattr(args, "json", None) is True
    try:
        status: int = args.func(args)
    except (*REPORTED, KeyboardInterrupt) as exc:
        return report_failure(f"checknrun {args.command}", exc, as_json=as_json)
    return status


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are `UsageError`s, reported by `parse_command_line`
    like every other failure (its sub-command parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def asks_for_json(parser: argparse.ArgumentParser, arguments: Sequence[str]) -> bool:
    """Whether `arguments` ask for JSON on stdout: `--json` is among them and, in the parser of
    the (sub-)command they name, a flag (`store_true`), as `run_command` decides it; a `--json
    OUT` that names a file (bench) is not."""
    for index, argument in enumerate(arguments):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) and argument in action.choices:
                return asks_for_json(action.choices[argument], arguments[index + 1 :])
    return "--json" in arguments and any(
        "--json" in action.option_strings and isinstance(action, argparse._StoreTrueAction)
        for action in parser._actions
    )


def parse_command_line(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """`parser.parse_args(argv)`; a usage error (with a `CommandParser`) is reported in one line
    (and as the JSON error document when the arguments ask for JSON: `asks_for_json`), then
    exits with 2."""
    arguments = sys.argv[1:] if argv is None else list(argv)
    try:
        return parser.parse_args(arguments)
    except UsageError as exc:
        as_json = asks_for_json(parser, arguments)
        raise SystemExit(report_failure(parser.prog, exc, as_json=as_json)) from exc


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (a bad one is a usage error, exit status 2)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_number(text: str) -> float:
    """An argparse type: a finite number >= 0 (else a usage error, exit status 2)."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


#: seconds, a finite number >= 0.
non_negative_seconds = non_negative_number


def add_store_args(parser: argparse.ArgumentParser, *, model_required: bool = True) -> None:
    """--store and --model, shared by every command that reads or writes a model."""
    parser.add_argument(
        "--store",
        default=DEFAULT_STORE,
        help="file:///PATH (embedded) or s3://BUCKET/PREFIX (default %(default)s)",
    )
    parser.add_argument("--model", required=model_required, help="model name")


def _version_row(ref: VersionRef) -> dict[str, Any]:
    m = ref.manifest
    return {
        "version": m.version,
        "kind": m.kind,
        "parent": m.parent,
        "baseline": m.baseline,
        "applies_to": m.applies_to,
        "policy": m.policy,
        # Blobs and manifest, against docs/FORMAT.md 3.1's full fp32 checkpoint (as `train`).
        "bytes": m.written_bytes,
        # The id-map blobs' share of `bytes` (docs/FORMAT.md section 7).
        "id_map_bytes": sum(t.id_map_bytes for t in m.tables),
        "full_fp32_bytes": m.full_fp32_bytes,
        "ratio_vs_full_fp32": round(m.ratio_to_full_fp32, 3),
        "created_at": m.created_at.isoformat(),
        "step": m.position.step,
        "samples_seen": m.position.samples_seen,
        "manifest": ref.key,
        "codec": ",".join(sorted({t.codec for t in m.tables})),
        # What quantization costs the version as served (docs/FORMAT.md 3.2); null: unmeasured.
        "served_loss": None if m.served_loss is None else m.served_loss.model_dump(),
    }


def _served_auc_loss(row: Mapping[str, Any]) -> str:
    """The served model's relative AUC loss against fp32 (the manifest's `auc_rel_loss`, in %:
    positive when the served model ranks worse), as `ls` prints it ("-" when unmeasured)."""
    loss = row["served_loss"]
    return "-" if loss is None else f"{100 * loss['auc_rel_loss']:+.4f}%"


def _unreadable_doc(unreadable: UnreadableManifest) -> dict[str, Any]:
    return {
        "version": unreadable.version,
        "manifest": unreadable.key,
        "error": type(unreadable.error).__name__,
        "message": error_message(unreadable.error),
    }


def _warn_unreadable(command: str, unreadable: Sequence[UnreadableManifest]) -> None:
    """One line on stderr naming the manifests a store command could not read (its report on
    stdout, text or JSON, says more)."""
    if unreadable:
        named = ", ".join(f"{u.key} (version {u.version})" for u in unreadable)
        print(f"checknrun {command}: warning: unreadable manifests: {named}", file=sys.stderr)


def cmd_ls(args: argparse.Namespace) -> int:
    """List the committed versions, and each manifest that could not be read.

    A manifest on HEAD's chain that cannot be read cuts it: the versions above it are listed
    as committed, it is named with its typed error, and the manifests stored behind it are
    listed as unverified (nothing links them to HEAD any more). The exit status is 0 when HEAD's
    version could be listed: the listing is what was asked for, its problems are reported in it
    (`unreadable` in JSON, and a warning on stderr), and a script that tells a model with a
    broken history apart reads them. Only when HEAD's own manifest cannot be read is nothing
    listable: a CatalogError, exit 1.
    """
    with open_store(args.store, create=False) as store:
        catalog = Catalog(store, args.model)
        history = catalog.history()
        broken = history.unreadable
        if broken is not None and not history.versions:
            raise CatalogError(
                f"model {args.model!r}: the manifest of its latest version {broken.version} "
                f"cannot be read, so no version can be listed: {broken.key}: {broken.reason}"
            ) from broken.error
        behind: list[VersionRef] = []
        unreadable = [] if broken is None else [broken]
        if broken is not None and broken.version is not None:
            behind, unreadable_behind = catalog.stored_below(broken.version)
            unreadable += unreadable_behind
        rows = [_version_row(r) for r in history.versions]
        unverified = [_version_row(r) for r in behind]
        if not rows:
            catalog.require_model()
        statuses = release_statuses(
            ReleaseLog(store, args.model, catalog), [r["version"] for r in rows]
        )
        for row in rows:
            row["release"] = statuses[row["version"]].to_json()
    _warn_unreadable("ls", unreadable)
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "versions": rows,
                    "unreadable": [_unreadable_doc(u) for u in unreadable],
                    "unverified": unverified,
                }
            )
        )
        return 0
    if not rows:
        print(f"model {args.model!r} has no committed version in {args.store}")
        return 0
    _print_listing(rows, unverified, unreadable)
    return 0


#: `ls`'s mark on a manifest stored behind one that cut HEAD's chain.
UNVERIFIED_MARK = "(unverified)"
#: the release statuses whose reason `ls` prints after the line (`--json` has every reason).
_SAYS_WHY = ("held", "rolled_back", "released", "unreadable")


def _short(text: str, width: int = 100) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _print_listing(
    rows: list[dict[str, Any]],
    unverified: list[dict[str, Any]],
    unreadable: list[UnreadableManifest],
) -> None:
    """`ls`'s table, oldest first: the committed versions, the manifests behind a broken link
    (marked unverified), and a line for each manifest that could not be read."""
    id_maps = any(r["id_map_bytes"] for r in (*rows, *unverified))
    id_map_column = f" {'id maps':>10}" if id_maps else ""
    # A model with a release gate (docs/FORMAT.md 9): each version's status, and why.
    gated = any(r.get("release", {}).get("status", "-") != "-" for r in rows)
    release_column = f" {'release':<11}" if gated else ""
    print(
        f"{'version':>8} {'kind':<6} {'parent':>6} {'bytes':>12}{id_map_column} {'vs fp32':>8} "
        f"{'codec':<6} {'served AUC loss':>15}{release_column}  created_at"
    )
    lines: list[tuple[int, str]] = []
    for r, note in [(r, "") for r in rows] + [(r, f"  {UNVERIFIED_MARK}") for r in unverified]:
        parent = "-" if r["parent"] is None else r["parent"]
        id_map_bytes = f" {r['id_map_bytes']:>10,}" if id_maps else ""
        release = r.get("release") or {"status": "-", "reason": None}
        status = f" {release['status']:<11}" if gated else ""
        why = release["reason"] if gated and release["status"] in _SAYS_WHY else None
        lines.append(
            (
                r["version"],
                f"{r['version']:>8} {r['kind']:<6} {parent:>6} {r['bytes']:>12,}{id_map_bytes} "
                f"{r['ratio_vs_full_fp32']:>7}x {r['codec']:<6} {_served_auc_loss(r):>15}"
                f"{status}  {r['created_at']}{note}" + (f"  {_short(why)}" if why else ""),
            )
        )
    for u in unreadable:
        version = "?" if u.version is None else u.version
        lines.append((u.version or 0, f"{version:>8} UNREADABLE {u.key}: {u.reason}"))
    for _, line in sorted(lines, key=lambda item: item[0]):
        print(line)
    if unverified:
        print(
            f"{UNVERIFIED_MARK}: a manifest stored behind an unreadable one: nothing links it to "
            "HEAD (it may be a crashed publish's orphan), so inspect and restore refuse it"
        )


def _ids_held(m: Manifest, t: TableEntry) -> int | None:
    """The ids the version's dynamic id map of `t` holds, as its writer recorded them."""
    held = m.metrics.get(f"{IDS_HELD_METRIC}{t.name}") if t.has_id_map else None
    return None if held is None else int(held)


def _shards_note(shards: object) -> str:
    return f"  in {len(shards)} row-range shards" if isinstance(shards, list) else ""


def _row_bytes(t: TableEntry) -> int:
    """Bytes of a table's row blobs: its blob, or all of its shards'."""
    return sum(part.blob.size for part in t.parts)


def cmd_inspect(args: argparse.Namespace) -> int:
    with open_store(args.store, create=False) as store:
        catalog = Catalog(store, args.model)
        ref = catalog.find(args.version)
        release = release_statuses(ReleaseLog(store, args.model, catalog), [ref.version])
    status = release[ref.version]
    m = ref.manifest
    tables = [
        {
            "name": t.name,
            "rows": t.rows,
            "dim": t.dim,
            "codec": t.codec,
            "rows_in_checkpoint": t.rows_in_checkpoint,
            "fraction": round(t.rows_in_checkpoint / t.rows, 6),
            "bytes": _row_bytes(t),
            "full_fp32_bytes": t.full_fp32_bytes(m.metrics),
            "ratio_vs_full_fp32": round(
                ratio_to_full_fp32(t.full_fp32_bytes(m.metrics), _row_bytes(t)), 3
            ),
            "key": None if t.blob is None else t.blob.key,
            # A table stored in row-range shards (docs/FORMAT.md section 3.3); null: one blob.
            "shards": None
            if t.shards is None
            else [
                {
                    "rank": s.rank,
                    "row_start": s.row_start,
                    "row_end": s.row_end,
                    "rows_in_checkpoint": s.rows_in_checkpoint,
                    "bytes": s.blob.size,
                    "key": s.blob.key,
                }
                for s in t.shards
            ],
            # The id map of the same rows (docs/FORMAT.md section 7); null without one.
            "id_map_bytes": t.id_map_bytes if t.has_id_map else None,
            "id_map_keys": [ref.key for ref in t.id_map_refs],
            "ids_held": _ids_held(m, t),
        }
        for t in m.tables
    ]
    doc = {
        **_version_row(ref),
        "tables": tables,
        "metrics": m.metrics,
        "position": m.position.model_dump(),
        "model_config": m.model_config_,
        "dense_bytes": m.dense.size if m.dense else 0,
        "optimizer_bytes": m.optimizer.size if m.optimizer else 0,
        "manifest_bytes": len(m.to_json()),
        # The release gate's status and evaluation (docs/FORMAT.md 9); "-": no gate.
        "release": status.to_json(),
        "evaluation": None
        if status.evaluation is None
        else status.evaluation.model_dump(mode="json"),
    }
    if args.json:
        print(json.dumps(doc))
        return 0
    print(
        f"{args.model} v{m.version} ({m.kind}, policy {m.policy}, baseline {m.baseline}, "
        f"applies to {m.applies_to}) created {m.created_at.isoformat()}"
    )
    of_which = f" ({doc['id_map_bytes']:,} in id maps)" if doc["id_map_bytes"] else ""
    print(
        f"step {m.position.step}, samples {m.position.samples_seen}, "
        f"{doc['bytes']:,} bytes{of_which} = {doc['ratio_vs_full_fp32']}x smaller than full fp32"
    )
    _print_served_loss(m.served_loss)
    _print_release(status)
    id_maps = any(t["id_map_bytes"] is not None for t in tables)
    id_map_columns = f" {'id map':>10} {'ids held':>10}" if id_maps else ""
    print(
        f"{'table':<24} {'rows':>10} {'dim':>5} {'codec':<14} {'in ckpt':>10} "
        f"{'bytes':>12} {'vs fp32':>8}{id_map_columns}"
    )
    for t in tables:
        if id_maps:
            held = "-" if t["ids_held"] is None else f"{t['ids_held']:,}"
            map_bytes = "-" if t["id_map_bytes"] is None else f"{t['id_map_bytes']:,}"
            id_map_columns = f" {map_bytes:>10} {held:>10}"
        print(
            f"{t['name']:<24} {t['rows']:>10} {t['dim']:>5} {t['codec']:<14} "
            f"{t['rows_in_checkpoint']:>10} {t['bytes']:>12,} {t['ratio_vs_full_fp32']:>7}x"
            f"{id_map_columns}{_shards_note(t['shards'])}"
        )
    if m.metrics:
        print("metrics: " + ", ".join(f"{k}={v:.5g}" for k, v in sorted(m.metrics.items())))
    return 0


def _print_release(status: VersionRelease) -> None:
    """The release gate's word on the version (docs/FORMAT.md 9), when the model has a gate."""
    if status.status == "-":
        return
    by = f" by the {status.by}" if status.by else ""
    print(f"release: {status.status}{by}" + (f": {status.reason}" if status.reason else ""))
    e = status.evaluation
    if e is None:
        return
    w = e.window
    print(
        f"  judged on {w.examples:,} events after it ({w.positives:,} positives): AUC "
        f"{_maybe(e.candidate.auc)}, log loss {e.candidate.logloss:.4f}"
        + ("" if e.baseline is None else f" against v{e.baseline}'s")
        + ("" if e.released is None else f" {_maybe(e.released.auc)}, {e.released.logloss:.4f}")
    )
    for name, interval, form in (
        ("AUC difference", e.auc_diff, "+.4f"),
        ("log loss difference", e.logloss_diff, "+.4f"),
        (f"v{e.baseline}'s log loss over its reference", e.drift, "+.1%"),
    ):
        if interval is not None:
            print(
                f"  {name} {interval.estimate:{form}}, {e.gate.level:.0%} interval "
                f"[{interval.low:{form}}, {interval.high:{form}}]"
            )


def _maybe(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _print_served_loss(loss: ServedLoss | None) -> None:
    """`inspect`'s line on what quantization costs the version as served (FORMAT.md 3.2)."""
    if loss is None:
        print("served loss: not measured")
        return
    print(
        f"served loss on {loss.samples:,} recent samples, as served vs fp32: "
        f"AUC {loss.auc_served:.6f} vs {loss.auc_fp32:.6f} "
        f"({-100 * loss.auc_rel_loss:+.4f}%), log loss {loss.logloss_served:.6f} vs "
        f"{loss.logloss_fp32:.6f} ({100 * loss.logloss_rel_increase:+.4f}%)" + _certainty(loss)
    )


def _certainty(loss: ServedLoss) -> str:
    """What the AUC loss rests on: its positives and the 95% interval, when recorded."""
    if loss.auc_loss_low is None or loss.auc_loss_high is None:
        return ""
    low, high = loss.auc_loss_low, loss.auc_loss_high
    verdict = "significant" if low > 0 else "within the samples' noise"
    return (
        f"; {loss.positives:,} positives, AUC loss 95% interval [{low:+.6f}, {high:+.6f}]: "
        f"{verdict}"
    )


def cmd_restore(args: argparse.Namespace) -> int:
    import torch  # only this command writes a torch file

    from publisher.read.restore import restore
    from publisher.state_dicts import weight_key

    if not Path(args.out).absolute().parent.is_dir():  # before the restore, not after it
        raise CommandError(f"--out {args.out}: no such directory")
    with open_store(args.store, create=False) as store:
        state = restore(store, args.model, args.version, progress=not args.json)
    model = {weight_key(name): torch.from_numpy(t.weights) for name, t in state.tables.items()}
    model.update({name: torch.from_numpy(value) for name, value in state.dense.items()})
    payload: dict[str, Any] = model
    if not args.model_only:
        # The layout docs/COMMANDS.md "Restore files" documents: the model's state_dict plus each
        # table's per-row optimizer columns, then the rest of the optimizer state.
        rows = {
            f"{name}.{OPTIMIZER_ROWS}": torch.from_numpy(t.aux)
            for name, t in state.tables.items()
            if t.aux.shape[1]
        }
        payload = {
            "state_dict": {**model, **rows},
            "optimizer": {k: torch.from_numpy(v) for k, v in state.optimizer.items()},
            "optimizer_meta": state.optimizer_meta,
            "manifest": json.loads(state.manifest.to_json()),
        }
    id_maps = {name: m.state() for name, m in state.id_maps.items()}
    id_maps_out = None
    if id_maps and not args.model_only:
        payload["id_maps"] = id_maps
    elif id_maps:
        # A strict load_state_dict takes no other key: the maps go beside the file.
        out = Path(args.out)
        id_maps_out = str(out.with_name(f"{out.stem}.id_maps.pt"))
    # Local files we write ourselves: torch.save is fine here.
    torch.save(payload, args.out)
    if id_maps_out is not None:
        torch.save(id_maps, id_maps_out)
        print(
            f"the id maps of tables {sorted(id_maps)} are in {id_maps_out} "
            "(IdMap.from_state of each)",
            file=sys.stderr,
        )
    doc = {
        "model": args.model,
        "version": state.version,
        "out": args.out,
        "bytes_read": state.bytes_read,
        "seconds": round(state.seconds, 4),
        "tables": len(state.tables),
        "model_only": args.model_only,
        "id_maps": sorted(id_maps),
        "id_maps_out": id_maps_out,
    }
    if args.json:
        print(json.dumps(doc))
    else:
        print(
            f"restored {args.model} v{state.version} ({state.bytes_read:,} bytes read in "
            f"{state.seconds:.2f} s) to {args.out}"
        )
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    """Delete what no kept version needs (publisher/read/retention.py).

    A manifest on HEAD's chain that cannot be read does not stop gc: it is named (in the report
    and in a warning on stderr) with what gc did about it, and the exit status is 0, as gc
    deleted only what it could prove no kept version needs.
    """
    from publisher.read.retention import plan_gc, run_gc

    with open_store(args.store, create=False) as store:
        plan = plan_gc(store, args.model, keep_baselines=args.keep_baselines, grace_s=args.grace)
        deleted = 0 if args.dry_run else run_gc(store, plan)
    unreadable = [] if plan.unreadable is None else [plan.unreadable]
    _warn_unreadable("gc", unreadable)
    doc = {
        "model": args.model,
        "dry_run": args.dry_run,
        "kept_versions": plan.kept_versions,
        "deleted_versions": plan.deleted_versions,
        "orphans": len(plan.orphan_keys),
        "keys_deleted": deleted,
        "bytes_freed": plan.bytes_freed,
        "bytes_kept": plan.bytes_kept,
        "unreadable": [_unreadable_doc(u) for u in unreadable],
        "keeps_behind_unreadable": plan.keeps_behind_unreadable,
        "kept_behind_unreadable": plan.kept_behind_unreadable,
    }
    if args.json:
        print(json.dumps(doc))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    print(
        f"{args.model}: {verb} versions {plan.deleted_versions or 'none'} and "
        f"{len(plan.orphan_keys)} orphan objects ({plan.bytes_freed:,} bytes); "
        f"kept {len(plan.kept_versions)} versions ({plan.bytes_kept:,} bytes)"
    )
    if plan.unreadable is not None:
        u = plan.unreadable
        if plan.keeps_behind_unreadable:
            fate = (
                f"it is kept, with the {plan.kept_behind_unreadable} objects of its version and "
                "older (a kept version may need them; without it they cannot be told from orphans)"
            )
        else:
            fate = "it is older than the oldest kept baseline: it and all behind it are orphans"
        print(f"{args.model}: unreadable manifest {u.key} (version {u.version}): {u.reason}")
        print(f"{args.model}: {fate}")
    return 0


def _builtin_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ls", help="list committed versions of a model")
    add_store_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", help="show one version's manifest and sizes")
    add_store_args(p)
    p.add_argument("--version", type=int, default=None, help="default: the latest")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("restore", help="rebuild a version and write it as a torch state file")
    add_store_args(p)
    p.add_argument("--version", type=int, default=None, help="default: the latest")
    p.add_argument("--out", required=True, help="output file (torch.save format)")
    p.add_argument(
        "--model-only",
        action="store_true",
        help="write the model's state_dict alone (loads with load_state_dict(strict=True)), "
        "and a version's id maps, if it has any, to OUT_STEM.id_maps.pt beside it; default: "
        "with the optimizer state, the id maps and the manifest (see README)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_restore)

    p = sub.add_parser("gc", help="delete versions and orphans no kept version needs")
    add_store_args(p)
    p.add_argument(
        "--keep-baselines", type=positive_int, default=2, help="full versions to keep (>= 1)"
    )
    p.add_argument(
        "--grace",
        type=non_negative_seconds,
        default=3600.0,
        help="never delete what is younger than this many seconds",
    )
    p.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_gc)

    from publisher.release.commands import cmd_release, cmd_rollback

    for name, func, helps in (
        ("release", cmd_release, "serve version V on the released track (a person's release)"),
        (
            "rollback",
            cmd_rollback,
            "move RELEASED back to version V (default: the last good one before it)",
        ),
    ):
        p = sub.add_parser(name, help=helps)
        p.add_argument(
            "version",
            type=positive_int,
            nargs=None if name == "release" else "?",
            metavar="V",
            help="the committed version" + ("" if name == "release" else " (optional)"),
        )
        add_store_args(p)
        p.add_argument("--reason", default=None, help="why, for the record (up to 1024 chars)")
        p.add_argument(
            "--bus",
            default=None,
            help="announce the move here (file:///PATH.log or kafka://HOST:PORT/TOPIC)",
        )
        p.add_argument("--json", action="store_true", help="print one JSON document")
        p.set_defaults(func=func)


#: the commands of this module (`_builtin_commands`); every other one is a plugin's.
BUILTIN_COMMANDS = ("ls", "inspect", "restore", "gc", "release", "rollback")
#: the top-level options that take no value and print nothing: the command word may follow them.
_QUIET_FLAGS = frozenset({"-v", "--verbose"})


def named_command(arguments: Sequence[str]) -> str | None:
    """The command `arguments` name: their first word, when nothing but `-v` precedes it; None
    when they ask for the top-level help, or start with anything else."""
    for argument in arguments:
        if argument not in _QUIET_FLAGS:
            return None if argument.startswith("-") else argument
    return None


def build_parser(arguments: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The `checknrun` parser, with the plugged-in commands that `arguments` need.

    A built-in command needs no plugin and a plugin's command only its own plugin; without
    `arguments`, or when they name no known command (`--help`, a usage error that lists the
    commands), every plugin is loaded. Loading one imports its registration module, so `ls`,
    `inspect` and `gc` never import what another command stands on (torch: 2 s), and a broken
    plugin cannot take the store commands down.
    """
    # Typed as the base: plugins register on `_SubParsersAction[ArgumentParser]`.
    parser: argparse.ArgumentParser = CommandParser(
        prog="checknrun",
        description="Incremental, quantized checkpoints published as live model updates.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _builtin_commands(sub)
    command = None if arguments is None else named_command(arguments)
    if command in BUILTIN_COMMANDS:
        return parser
    plugins = sorted(entry_points(group="checknrun.commands"), key=lambda e: e.name)
    for ep in [ep for ep in plugins if ep.name == command] or plugins:
        try:
            register: Callable[[Any], None] = ep.load()
        except ImportError as exc:  # a broken plugin must not take the other commands down
            print(f"checknrun: command {ep.name!r} unavailable: {exc}", file=sys.stderr)
            continue
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(arguments)
    args = parse_command_line(parser, arguments)
    configure_logging(logging.DEBUG if args.verbose else logging.INFO)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
