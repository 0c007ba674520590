"""A short prepared check of a sharded job on this machine's accelerator, next to `torch.save`.

    python -m bench.gpu_check [--device cuda|cpu] [--out DIR] [--small]
    bash scripts/gpu_check.sh          # the same on CUDA, results under $OUT (the device machine)

Unattended, in a few minutes on one GPU:

1. trains a sharded job with the project's own CLI in a child process (`checknrun train --nproc
   N --device D --data synthetic ... --codec int4 --json`): 2 ranks on CUDA where 2 GPUs exist,
   else 1 rank (`check_job_options` wants a GPU per rank; the output says which it ran);
2. reads every checkpoint's stall (rank 0's, from the report's `checkpoints`) and publish time,
   and each version's kind and rows from its manifest;
3. restores the last version (`publisher.read.restore.restore`) and checks that it has every
   table of the baseline, at its shape, and holds only finite values;
4. times `torch.save` of that same state (every table's weights and accumulator, the dense
   parameters and the dense optimizer, as tensors on the training device) into the work
   directory, median of 3: what a trainer that checkpoints with `torch.save` stops for;
5. prints a table naming the machine and writes the figures to DIR/gpu_check.json.

The store and the `torch.save` files go to a fresh work directory under DIR, deleted at the end
(the device machine sends back what is left under $OUT: only the JSON should travel). `--small`
shrinks every size so that the test suite runs the whole check on CPU in well under a minute;
its figures prove the script works, not what a GPU does. Nothing here needs a GPU to import, and
CI runs only the `--small` CPU check (tests/multiprocess/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.machine import describe_machine, log, write_json
from publisher.cli import CommandError, CommandParser, parse_command_line, run_command
from publisher.read.catalog import Catalog
from publisher.read.restore import RestoredState, restore
from publisher.store import FileStore

REPO = Path(__file__).resolve().parents[1]
MODEL = "gpu"
#: torch.save runs timed; the median is the baseline.
SAVE_REPEATS = 3


@dataclass(frozen=True)
class Sizes:
    """What the job trains: `--table-cap` rows per table at most (26 Criteo-like tables), rows
    of `embedding_dim`, `max_samples` in batches of `batch_size`, a checkpoint every
    `interval_samples`; the child process is killed after `timeout_s`."""

    table_cap: int
    embedding_dim: int
    batch_size: int
    max_samples: int
    interval_samples: int
    timeout_s: float


#: cap 730,000 is ~4.2M rows, ~1.08 GB of fp32 embeddings at dim 64 (trainer/streams/synthetic.py):
#: the full baseline is copied in chunks; 5 versions (a full and 4 deltas) in 245 steps.
FULL = Sizes(730_000, 64, 8192, 2_000_000, 400_000, 420.0)
#: the test suite's: seconds on 2 shared CPU cores, 5 versions of 26 tables of at most 1,000 rows.
SMALL = Sizes(1_000, 64, 256, 5_120, 1_024, 240.0)


@dataclass(frozen=True)
class Ranks:
    """How many ranks the job runs on the device, and why (said in the output)."""

    nproc: int
    note: str

    @classmethod
    def for_device(cls, device: str) -> Ranks:
        """2 ranks on CPU or on 2 GPUs; 1 on a machine with one GPU; CommandError with none."""
        if device == "cpu":
            return cls(2, "2 ranks on CPU (gloo)")
        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise CommandError("--device cuda: torch sees no GPU here (use --device cpu)")
        check_cuda_kernels()
        if gpus == 1:
            return cls(1, "1 rank on CUDA: one GPU here, and a sharded job wants a GPU per rank")
        return cls(2, f"2 ranks on CUDA ({gpus} GPUs here)")


def check_cuda_kernels() -> None:
    """Refuse, before minutes of start-up, an install whose TorchRec kernels are CPU-only:
    scripts/setup.sh installs `fbgemm-gpu-cpu` (the `sharded` extra), and TorchRec's sharded
    tables on CUDA need the CUDA build, `fbgemm-gpu`, of the same version."""
    try:
        metadata.distribution("fbgemm-gpu")
    except metadata.PackageNotFoundError:
        try:
            cpu = metadata.distribution("fbgemm-gpu-cpu").version
        except metadata.PackageNotFoundError:
            cpu = None
        if cpu is not None:
            raise CommandError(
                f"--device cuda: fbgemm-gpu-cpu {cpu} holds TorchRec's CPU kernels only; "
                f"install the CUDA build in its place (pip uninstall -y fbgemm-gpu-cpu && "
                f"pip install --no-deps fbgemm-gpu=={cpu})"
            ) from None
        raise CommandError("--device cuda: no fbgemm-gpu installed (the 'sharded' extra)") from None


def train_command(device: str, ranks: Ranks, sizes: Sizes, store: Path) -> list[str]:
    """The `train` command line of the job checked."""
    return [
        sys.executable,
        *("-m", "trainer.cli", "train"),
        *("--nproc", str(ranks.nproc), "--device", device, "--data", "synthetic"),
        *("--table-cap", str(sizes.table_cap), "--embedding-dim", str(sizes.embedding_dim)),
        *("--batch-size", str(sizes.batch_size), "--max-samples", str(sizes.max_samples)),
        *("--interval-samples", str(sizes.interval_samples), "--codec", "int4"),
        *("--store", f"file://{store}", "--model", MODEL, "--json", "--no-progress"),
    ]


def train(command: list[str], timeout_s: float) -> dict[str, Any]:
    """Run the job; its JSON report (CommandError when it fails or runs past `timeout_s`)."""
    try:
        done = subprocess.run(
            command,
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise CommandError(f"the training job ran past {timeout_s:.0f} s: {command}") from exc
    if done.returncode != 0:
        raise CommandError(
            f"the training job exited {done.returncode}: {done.stderr.strip()[-2000:]}"
        )
    lines = done.stdout.strip().splitlines()
    if not lines:
        raise CommandError(f"the training job printed no report; stderr: {done.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def version_figures(store: FileStore, report: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per committed version: its kind and rows (manifest), the stall of the
    checkpoint that made it and its publish seconds (rank 0's record in the report)."""
    records = {r["version"]: r for r in report["checkpoints"] if r["version"] is not None}
    catalog = Catalog(store, MODEL)
    figures = []
    for ref in catalog.versions():
        manifest = catalog.find(ref.version).manifest
        record = records.get(ref.version)
        if record is None:
            raise CommandError(f"version {ref.version} has no checkpoint record in the report")
        figures.append(
            {
                "version": ref.version,
                "kind": manifest.kind,
                "rows_in_checkpoint": sum(t.rows_in_checkpoint for t in manifest.tables),
                "bytes": record["bytes"],
                "stall_ms": record["stall_ms"],
                "publish_s": record["publish_s"],
            }
        )
    return figures


def restored_and_checked(store: FileStore) -> tuple[RestoredState, dict[str, Any]]:
    """The last version restored, and what the check found: CommandError unless it has every
    table of the model's first version, at that table's shape, and only finite values."""
    catalog = Catalog(store, MODEL)
    refs = catalog.versions()
    if not refs:
        raise CommandError(f"the job committed no version of {MODEL!r}")
    baseline = catalog.find(refs[0].version).manifest
    started = time.perf_counter()
    state = restore(store, MODEL)
    seconds = time.perf_counter() - started
    if state.version != refs[-1].version:
        raise CommandError(f"restored version {state.version}, the last is {refs[-1].version}")
    missing = sorted({t.name for t in baseline.tables} - set(state.tables))
    if missing:
        raise CommandError(f"version {state.version} restored without tables {missing}")
    for entry in baseline.tables:
        shape = state.tables[entry.name].weights.shape
        if shape != (entry.rows, entry.dim):
            raise CommandError(
                f"table {entry.name!r} restored as {shape}, expected {(entry.rows, entry.dim)}"
            )
    arrays = [a for t in state.tables.values() for a in (t.weights, t.aux)]
    arrays += [*state.dense.values(), *state.optimizer.values()]
    bad = sum(int(np.count_nonzero(~np.isfinite(a))) for a in arrays)
    if bad:
        raise CommandError(f"version {state.version} restored with {bad} non-finite values")
    check = {
        "version": state.version,
        "tables": len(state.tables),
        "finite": True,
        "passed": True,  # every check above raises on a failure
        "seconds": seconds,
    }
    return state, check


def device_state(state: RestoredState, device: torch.device) -> dict[str, torch.Tensor]:
    """The restored state as one dict of tensors on `device`: what `torch.save` is timed on."""
    tensors: dict[str, torch.Tensor] = {}
    for name, table in state.tables.items():
        tensors[f"tables.{name}.weight"] = torch.from_numpy(table.weights).to(device)
        tensors[f"tables.{name}.aux"] = torch.from_numpy(table.aux).to(device)
    for key, value in state.dense.items():
        tensors[f"dense.{key}"] = torch.from_numpy(np.ascontiguousarray(value)).to(device)
    for key, value in state.optimizer.items():
        tensors[f"optimizer.{key}"] = torch.from_numpy(np.ascontiguousarray(value)).to(device)
    return tensors


def torch_save_seconds(
    tensors: dict[str, torch.Tensor], work: Path, repeats: int = SAVE_REPEATS
) -> list[float]:
    """Seconds of each of `repeats` `torch.save`s of `tensors` to a file in `work` (the page
    cache: no fsync, as the checkpointer's stall has no disk in it either)."""
    path = work / "torch_save.pt"
    runs = []
    for _ in range(repeats):
        _synchronize(tensors)
        started = time.perf_counter()
        torch.save(tensors, path)
        runs.append(time.perf_counter() - started)
        path.unlink()
    return runs


def _synchronize(tensors: dict[str, torch.Tensor]) -> None:
    if any(t.is_cuda for t in tensors.values()):
        torch.cuda.synchronize()


def machine(device: str) -> dict[str, Any]:
    """The machine (bench/machine.py's record) and its GPU, named as CUDA names it."""
    doc = describe_machine()
    cuda = device == "cuda" and torch.cuda.is_available()
    doc["gpu"] = torch.cuda.get_device_name(0) if cuda else None
    doc["gpus"] = torch.cuda.device_count() if cuda else 0
    return doc


def _median(values: Sequence[float | None]) -> float:
    present = [v for v in values if v is not None]
    if not present:
        raise CommandError("no figure to take a median of")
    return float(statistics.median(present))


def check(device: str, out: Path, sizes: Sizes) -> dict[str, Any]:
    """Run the whole check; its figures (also written to `out`/gpu_check.json)."""
    ranks = Ranks.for_device(device)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=out))
    try:
        command = train_command(device, ranks, sizes, work / "store")
        log(f"gpu_check: {ranks.note}; training {sizes.max_samples:,} samples")
        report = train(command, sizes.timeout_s)
        store = FileStore(work / "store")
        versions = version_figures(store, report)
        log("gpu_check: restoring the last version")
        state, restored = restored_and_checked(store)
        train_device = torch.device("cuda" if device == "cuda" else "cpu")
        tensors = device_state(state, train_device)
        del state
        log(f"gpu_check: torch.save of the same state, {SAVE_REPEATS} times")
        save_runs = torch_save_seconds(tensors, work)
        save_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stalls = [r["stall_ms"] for r in report["checkpoints"]]
    stall_ms = _median(stalls)
    torch_save_s = _median(save_runs)
    doc: dict[str, Any] = {
        "machine": machine(device),
        "device": device,
        "nproc": ranks.nproc,
        "ranks": ranks.note,
        "sizes": asdict(sizes),
        "command": command[1:],
        "samples": report["samples"],
        "samples_per_s": report["samples_per_s"],
        "versions": versions,
        "stall_ms": stalls,
        "stall_ms_median": stall_ms,
        "full_stall_ms": _median([v["stall_ms"] for v in versions if v["kind"] == "full"]),
        "publish_s_median": _median([v["publish_s"] for v in versions]),
        "restore": restored,
        "restore_s": restored["seconds"],
        "torch_save_s": torch_save_s,
        "torch_save_s_runs": save_runs,
        "torch_save_bytes": save_bytes,
        "stall_over_torch_save": stall_ms / 1e3 / torch_save_s,
    }
    write_json(doc, out / "gpu_check.json")
    return doc


def table(doc: dict[str, Any]) -> str:
    """The figures as a small table, the machine named above it."""
    m = doc["machine"]
    where = f"{m['gpu']} ({m['gpus']} GPU(s)), " if m["gpu"] else ""
    rows = [
        ("samples/s", f"{doc['samples_per_s']:,.0f}"),
        ("stall ms, median per checkpoint", f"{doc['stall_ms_median']:.2f}"),
        ("stall ms, full baseline", f"{doc['full_stall_ms']:.2f}"),
        ("publish s, median per version", f"{doc['publish_s_median']:.3f}"),
        ("restore s, last version", f"{doc['restore_s']:.3f}"),
        (f"torch.save s, median of {SAVE_REPEATS}", f"{doc['torch_save_s']:.3f}"),
        ("stall / torch.save", f"{doc['stall_over_torch_save']:.4f}"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [
        f"gpu_check on {where}{m['cpu_model']} ({m['nproc']} cores), torch {m['torch']}",
        f"{doc['ranks']}; {doc['samples']:,} samples, {len(doc['versions'])} versions, "
        f"torch.save of {doc['torch_save_bytes'] / 1e6:,.1f} MB",
        *(f"  {name:<{width}}  {value:>12}" for name, value in rows),
    ]
    return "\n".join(lines)


def cmd_gpu_check(args: argparse.Namespace) -> int:
    """`python -m bench.gpu_check`: run the check, print its table."""
    sizes = SMALL if args.small else FULL
    doc = check(args.device, Path(args.out), sizes)
    print(table(doc))
    print(f"figures in {Path(args.out) / 'gpu_check.json'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.gpu_check [--device cuda|cpu] [--out DIR] [--small]`."""
    parser = CommandParser(prog="python -m bench.gpu_check", description=__doc__)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", default="/tmp/gpu_check", help="where gpu_check.json goes")
    parser.add_argument(
        "--small", action="store_true", help="tiny sizes: proves the script, measures nothing"
    )
    parser.set_defaults(command="gpu_check", func=cmd_gpu_check)
    return run_command(parse_command_line(parser, argv))


if __name__ == "__main__":
    sys.exit(main())
