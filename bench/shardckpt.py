"""Part `shardckpt`: a sharded job's checkpoints on 1 vs 2 ranks, the same model and data.

    checknrun bench shardckpt [--rows 400000 --dim 32 --steps 24 --every 4 --batch 2048
                               --codec int4 --repeats 2 --full-chunk-mib 32] [--quick] [--json OUT]

Trains bench/sharded_job.py's DLRM (tables `user` of `--rows` rows split row-wise over the
ranks, `item` and `ad` of a half and a quarter of that held whole) for `--steps` steps of one
global batch of `--batch` samples (each rank trains its part of it), with a consecutive-delta
`ShardedCheckpointer` every `--every` steps into a temporary file store, on 1 rank and then 2
ranks, alternating, `--repeats` times: the two arms run side by side in one run on the same
machine. Reports per arm the median stall of each rank (the training thread's stop: dirty rows,
the all_reduce, plan, copies, hand-off), the median publish time per version on rank 0 (its
round: reserve, encode and upload its blobs, wait for every rank's report, manifest and HEAD),
and the bytes each rank wrote per version (median, fulls and deltas apart). The first
checkpoint (the full baseline) is left out of the stall and publish medians; its stops are
reported apart (`full_stop_ms_median` and `_max`, `full_stops`): copied in chunks of
`--full-chunk-mib` per step (0: in one stop), it stops once per chunk and once more to copy the
rows changed meanwhile (run it with `--steps` past `--every` plus its chunk count, or `close`
completes it in one stop).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.machine import describe_machine, log
from bench.sharded_job import EPS, SPARSE_LR, run_ranks, sharded_job, train_sharded
from publisher.cli import positive_int
from publisher.dlrm import DLRMConfig, SparseFeature
from publisher.store import FileStore
from publisher.tunables import DEFAULT_TUNABLES, Tunables
from publisher.write.publishing import PublishResult
from schemas.codec_names import CODECS
from schemas.manifest import BlobRef, Manifest

#: the sizes `--quick` shrinks: option -> (default, quick). Given options win.
SIZES: dict[str, tuple[int, int]] = {
    "rows": (400_000, 20_000),
    "steps": (24, 12),
    "batch": (2048, 256),
    "repeats": (2, 1),
}
WORLDS = (1, 2)
#: MiB of a full baseline copied per step by default: the trainers' (0: one stop).
DEFAULT_CHUNK_MIB = (DEFAULT_TUNABLES.full_copy_chunk_bytes or 0) >> 20
SHARDING = {"user": "row_wise", "item": "table_wise", "ad": "table_wise"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, the run, the interval, the codec and the repeats."""
    for name, (default, quick) in SIZES.items():
        parser.add_argument(
            f"--{name}", type=positive_int, help=f"default {default:,}; --quick {quick:,}"
        )
    parser.add_argument("--dim", type=positive_int, default=32, help="elements per row")
    parser.add_argument("--every", type=positive_int, default=4, help="steps per checkpoint")
    parser.add_argument("--codec", choices=CODECS, default="int4", help="the tables' codec")
    parser.add_argument(
        "--full-chunk-mib",
        type=_mib,
        default=DEFAULT_CHUNK_MIB,
        help="MiB of a full baseline copied per step (0: the whole full in one stop)",
    )


def _mib(text: str) -> int:
    """A whole number of MiB, 0 or more (argparse type)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected MiB >= 0, got {text}")
    return value


def config_of(rows: int, dim: int) -> DLRMConfig:
    return DLRMConfig(
        sparse=(
            SparseFeature("user", rows),
            SparseFeature("item", max(rows // 2, 1)),
            SparseFeature("ad", max(rows // 4, 1)),
        ),
        dense=("x0", "x1"),
        embedding_dim=dim,
        bottom_mlp=(64,),
        top_mlp=(64, 32),
    )


def _job(rank: int, world: int, root: str, options: dict[str, Any]) -> None:
    """One rank of one arm: train, checkpoint, write its figures to `root/rankR.json`."""
    from trainer.sharded.checkpointing import ShardedCheckpointer
    from trainer.sharded.collective import TorchCollective

    config = DLRMConfig.from_json(options["config"])
    job = sharded_job(SHARDING, config=config)
    results: list[PublishResult] = []
    batch, every = int(options["batch"]), int(options["every"])
    ckpt = ShardedCheckpointer(
        job.model,
        job.dense_optimizer,
        store=FileStore(Path(root) / "store"),
        model_name="bench",
        collective=TorchCollective.new(timeout_s=300.0),
        sparse_hyper={"lr": SPARSE_LR, "eps": EPS},
        policy="consecutive",
        codec=str(options["codec"]),
        interval_samples=every * batch,
        model_config=config.to_json(),
        on_published=results.append,
        tunables=Tunables(full_copy_chunk_bytes=int(options["full_chunk_mib"]) << 20 or None),
    )
    with ckpt:
        for step in range(int(options["steps"])):
            train_sharded(job, seed=step, size=batch, config=config, part=(rank, world))
            ckpt.step(batch, batch // world)
            ckpt.maybe_checkpoint(reader={"step": step + 1})
    full = ckpt.records[0]
    figures = {
        # a chunked full's stops: its first and one per chunk, then the last (copy, hand-off)
        "full_stops_ms": [
            *full.pauses_ms,
            full.stall_breakdown_ms["copy"] + full.stall_breakdown_ms["handoff"]
            if full.pauses_ms
            else full.stall_ms,
        ],
        "stall_ms": [r.stall_ms for r in ckpt.records],
        "rows_copied": [r.rows_copied for r in ckpt.records],
        "publish_s": [r.encode_s + r.commit_s for r in results],
        "merged": [r.merged for r in results],
        "bytes_per_rank": [(r.manifest.kind, _bytes_per_rank(r.manifest)) for r in results],
    }
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(figures))


def _bytes_per_rank(manifest: Manifest) -> dict[str, int]:
    """Bytes of the version's blobs by the rank directory (`rRRRR`) of their keys."""
    blobs: list[BlobRef] = [b for b in (manifest.dense, manifest.optimizer) if b is not None]
    for table in manifest.tables:
        if table.blob is not None:
            blobs.append(table.blob)
        blobs.extend(s.blob for s in table.shards or ())
    out: dict[str, int] = {}
    for blob in blobs:
        rank = next((p for p in blob.key.split("/") if p.startswith("r") and p[1:].isdigit()), "")
        out[rank] = out.get(rank, 0) + blob.size
    return out


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def run(
    quick: bool,
    rows: int | None = None,
    steps: int | None = None,
    batch: int | None = None,
    repeats: int | None = None,
    dim: int = 32,
    every: int = 4,
    codec: str = "int4",
    full_chunk_mib: int = DEFAULT_CHUNK_MIB,
) -> dict[str, Any]:
    """Both arms, alternating `repeats` times; medians per arm and the 2-rank / 1-rank ratios."""
    sizes = {k: (d, q) for k, (d, q) in SIZES.items()}
    given = {"rows": rows, "steps": steps, "batch": batch, "repeats": repeats}
    chosen = {k: v if v is not None else sizes[k][1 if quick else 0] for k, v in given.items()}
    config = config_of(chosen["rows"], dim)
    options = {
        **chosen,
        "every": every,
        "codec": codec,
        "full_chunk_mib": full_chunk_mib,
        "config": config.to_json(),
    }
    gathered: dict[int, list[dict[str, Any]]] = {w: [] for w in WORLDS}
    for repeat in range(chosen["repeats"]):
        for world in WORLDS:
            log(f"shardckpt: repeat {repeat + 1}, {world} rank(s)")
            with tempfile.TemporaryDirectory(prefix="checknrun-shardckpt-") as root:
                run_ranks(_job, world, root, options)
                gathered[world].extend(
                    {"rank": r, **json.loads((Path(root) / f"rank{r}.json").read_text())}
                    for r in range(world)
                )
    arms: dict[str, Any] = {}
    for world, runs in gathered.items():
        per_rank: dict[str, Any] = {}
        for rank in range(world):
            mine = [one for one in runs if one["rank"] == rank]
            # the first checkpoint is the full baseline: a different size of work
            stalls = [s for one in mine for s in one["stall_ms"][1:]]
            copied = [c for one in mine for c in one["rows_copied"][1:]]
            full_stops = [s for one in mine for s in one["full_stops_ms"]]
            per_rank[str(rank)] = {
                "full_stop_ms_median": _median(full_stops),
                "full_stop_ms_max": round(max(full_stops), 3),
                "full_stops": len(full_stops) // len(mine),
                "stall_ms_median": _median(stalls),
                "rows_copied_median": _median([float(c) for c in copied]),
            }
        lead = [one for one in runs if one["rank"] == 0]
        publish = [p for one in lead for p in one["publish_s"][1:]]
        by_rank: dict[str, dict[str, list[float]]] = {}
        for one in lead:
            for kind, version in one["bytes_per_rank"]:
                for key, size in version.items():
                    by_rank.setdefault(kind, {}).setdefault(key, []).append(float(size))
        arms[str(world)] = {
            "ranks": per_rank,
            "publish_s_median": _median(publish),
            "versions": sum(len(one["publish_s"]) for one in lead),
            "merged_snapshots": sum(m - 1 for one in lead for m in one["merged"]),
            "bytes_per_rank_median": {
                kind: {k: _median(v) for k, v in sorted(sizes.items())}
                for kind, sizes in sorted(by_rank.items())
            },
        }
    single, double = arms["1"], arms["2"]
    ratios = {
        "publish_s_2_over_1": _ratio(double["publish_s_median"], single["publish_s_median"]),
        "stall_ms_rank0_2_over_1": _ratio(
            double["ranks"]["0"]["stall_ms_median"], single["ranks"]["0"]["stall_ms_median"]
        ),
    }
    for name, arm in arms.items():
        per_rank_text = ", ".join(
            f"rank {r}: {v['stall_ms_median']} ms (full: {v['full_stops']} stops, median "
            f"{v['full_stop_ms_median']} ms, max {v['full_stop_ms_max']} ms)"
            for r, v in arm["ranks"].items()
        )
        print(
            f"{name} rank(s): stall {per_rank_text}; publish {arm['publish_s_median']} s "
            f"per version ({arm['versions']} versions); "
            f"bytes per rank {arm['bytes_per_rank_median']}"
        )
    print(f"2 ranks / 1 rank: {ratios}")
    return {
        "part": "shardckpt",
        "machine": describe_machine(),
        "options": {k: v for k, v in options.items() if k != "config"},
        "tables": {f.name: f.rows for f in config.sparse},
        "arms": arms,
        "ratios": ratios,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None
