"""Part `endpoint`: what an answer costs over each way in, next to the model's own forward.

    checknrun bench endpoint [--rows 100000] [--requests 200] [--quick] [--json OUT]

One DLRM (a 100,000-row int4 item table, a user table, a bag, 4 dense inputs; bench/serving.py's
`bench_config`) published to a file store, then, at batch 1, 64 and 1024, sequential requests
(one connection kept alive, the same body each time) to each arm, one after the other:

- `forward`: the trainer's fp32 DLRM's forward in this process, on a prepared batch (one torch
  thread): the floor any endpoint adds to;
- `naive`: bench/naive_endpoint.py, the FastAPI endpoint a user writes in an afternoon (json,
  a loop per feature, the forward, JSONResponse), in a process of its own;
- `v1`: `checknrun serve`'s `/v1/predict` (JSON examples);
- `v1 columns`: the same route with the columnar form (one JSON list per input);
- `v2 http`: the same server's v2 REST infer with `tritonclient.http` (binary tensors);
- `v2 grpc`: the same server's v2 gRPC infer with `tritonclient.grpc`.

Each server holds the int4 tables quantized (the default) and runs one torch thread. Reported
per arm and batch: p50 and p99 (ms), and p50 / the forward's; a PNG
(docs/benchmarks/endpoint.png).

Then throughput at batch 64: `wrk` (bench/wrk_load.py; `apt-get install wrk`) posting each HTTP
arm's body over 8 connections for `--seconds`: requests/s, p50, p99 and failed requests (gRPC is
HTTP/2, which wrk does not speak). Without wrk this phase is skipped, and says so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from bench.child_server import REPO, ChildServer, free_port
from bench.endpoint_workers import bench_server, measure_workers
from bench.machine import describe_machine, log
from bench.predict_load import percentiles
from bench.serving import bench_config
from bench.synthetic_run import SyntheticRun, random_examples
from bench.wrk_load import have_wrk, wrk_load
from publisher.cli import positive_int
from publisher.store import FileStore
from server.feature_batch import build_batch

MODEL = "endpoint"
BATCHES = (1, 64, 1024)
#: option -> (default, --quick).
SIZES = {"rows": (100_000, 2_000), "requests": (200, 20), "seconds": (10, 1)}
ARMS = ("forward", "naive", "v1", "v1 columns", "v2 http", "v2 grpc")
#: the arms loaded by wrk, at this batch over this many connections.
LOADED = ("naive", "v1", "v1 columns", "v2 http")
LOAD_BATCH, CONNECTIONS = 64, 8
#: rows of the delta committed every second while `--workers` servers are loaded.
DELTA_ROWS = 100_000
PNG = Path("docs/benchmarks/endpoint.png")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=positive_int, help="item table rows (default 100,000)")
    parser.add_argument(
        "--requests", type=positive_int, help="requests per arm and batch (default 200)"
    )
    parser.add_argument(
        "--seconds", type=positive_int, help="seconds of wrk load per arm (default 10)"
    )


def run(
    quick: bool,
    *,
    rows: int | None = None,
    requests: int | None = None,
    seconds: int | None = None,
) -> dict[str, Any]:
    """Measure (see the module docstring); progress to stderr, the table to stdout."""
    n_rows = rows or SIZES["rows"][quick]
    n_requests = requests or SIZES["requests"][quick]
    n_seconds = seconds or SIZES["seconds"][quick]
    loads: dict[str, Any] = {}
    batches = BATCHES[:2] if quick else BATCHES
    torch.set_num_threads(1)
    config = bench_config(n_rows, 32)
    results: dict[str, dict[str, Any]] = {arm: {} for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="bench-endpoint-") as tmp:
        root = Path(tmp)
        run_ = SyntheticRun(FileStore(root / "store"), MODEL, config, codec="int4")
        run_.publish("full")
        store_url = f"file://{root / 'store'}"
        naive, naive_port = _naive(store_url, root)
        grpc_port = free_port()
        server = bench_server(
            store_url, MODEL, root / "serve.log", grpc_port=str(grpc_port), poll_head_after="30"
        )
        try:
            server.wait_ready()
            _wait_naive(naive, naive_port)
            for batch in batches:
                examples = random_examples(config, batch, seed=batch)
                log(f"endpoint: batch {batch}")
                for arm, call in _arms(run_, examples, server, naive_port, grpc_port).items():
                    results[arm][str(batch)] = _timed(call, n_requests)
            # one body per arm for both wrk phases (the v2 one is the --workers phase's too)
            load_examples = random_examples(config, LOAD_BATCH, seed=LOAD_BATCH)
            load_tensors = _tensors(config, load_examples)
            v2_body, v2_headers = _v2_body(load_tensors)
            loads = _loads(
                server, naive_port, n_seconds, load_examples, load_tensors, v2_body, v2_headers
            )
        finally:
            server.stop()
            naive.terminate()
            naive.wait(timeout=30)
        try:
            workers: dict[str, Any] = {"skipped": "wrk is not installed"}
            if have_wrk():
                workers = measure_workers(
                    store_url,
                    root,
                    run_,
                    MODEL,
                    v2_body,
                    v2_headers,
                    seconds=n_seconds,
                    delta_rows=min(DELTA_ROWS, n_rows),
                )
        finally:
            run_.close()
    doc = {
        "part": "endpoint",
        "machine": describe_machine(),
        "rows": n_rows,
        "requests": n_requests,
        "arms": results,
        "vs_forward_p50": {
            arm: {
                b: round(results[arm][b]["p50_ms"] / results["forward"][b]["p50_ms"], 2)
                for b in results["forward"]
            }
            for arm in ARMS
        },
        "load": loads,
        "workers": workers,
    }
    _print(doc, batches)
    if not quick:
        plot(doc, PNG)
    return doc


def _naive(store_url: str, root: Path) -> tuple[subprocess.Popen[bytes], int]:
    """bench/naive_endpoint.py started on a free port, and the port."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.naive_endpoint", store_url, MODEL, str(port)],
        cwd=REPO,
        stdout=(root / "naive.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    return process, port


def _wait_naive(process: subprocess.Popen[bytes], port: int, timeout_s: float = 120.0) -> None:
    url = f"http://127.0.0.1:{port}/docs"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the naive endpoint exited with status {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the naive endpoint did not start")


def _arms(
    run: SyntheticRun,
    examples: list[dict[str, Any]],
    server: ChildServer,
    naive_port: int,
    grpc_port: int,
) -> dict[str, Callable[[], object]]:
    """Each arm's one request for `examples`, checked to answer len(examples) scores."""
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton_http

    n = len(examples)
    model = run.model
    batch = build_batch(examples, model.config)
    body = json.dumps({"examples": examples}).encode()
    headers = {"Content-Type": "application/json"}
    naive_client = httpx.Client(base_url=f"http://127.0.0.1:{naive_port}")
    http = triton_http.InferenceServerClient(url=server.url.removeprefix("http://"))
    grpc = triton_grpc.InferenceServerClient(url=f"127.0.0.1:{grpc_port}")
    tensors = _tensors(model.config, examples)

    def forward() -> object:
        with torch.inference_mode():
            return model(batch.dense, batch.sparse)

    def post(client: httpx.Client, path: str) -> Callable[[], object]:
        def call() -> object:
            r = client.post(path, content=body, headers=headers)
            r.raise_for_status()
            assert len(r.json()["scores"]) == n
            return r

        return call

    columns = json.dumps({"columns": _columns(tensors)}).encode()

    def post_columns() -> object:
        r = server.client.post("/v1/predict", content=columns, headers=headers)
        r.raise_for_status()
        assert len(r.json()["scores"]) == n
        return r

    def infer(module: Any, client: Any) -> Callable[[], object]:
        inputs = []
        for name, array, datatype in tensors:
            tensor = module.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        outputs = [module.InferRequestedOutput("score")]

        def call() -> object:
            result = client.infer(MODEL, inputs, outputs=outputs)
            assert len(result.as_numpy("score")) == n
            return result

        return call

    return {
        "forward": forward,
        "naive": post(naive_client, "/predict"),
        "v1": post(server.client, "/v1/predict"),
        "v1 columns": post_columns,
        "v2 http": infer(triton_http, http),
        "v2 grpc": infer(triton_grpc, grpc),
    }


def _tensors(config: Any, examples: list[dict[str, Any]]) -> list[tuple[str, np.ndarray, str]]:
    """The v2 tensors of `examples` (docs/SERVER.md, "The v2 protocol")."""
    out: list[tuple[str, np.ndarray, str]] = []
    for f in config.sparse:
        if f.bag:
            ids = [v for ex in examples for v in ex[f.name]]
            lengths = [len(ex[f.name]) for ex in examples]
            out.append((f.name, np.asarray(ids, dtype=np.int64), "INT64"))
            out.append((f.name + "_lengths", np.asarray(lengths, dtype=np.int64), "INT64"))
        else:
            out.append((f.name, np.asarray([ex[f.name] for ex in examples], np.int64), "INT64"))
    for d in config.dense:
        out.append((d, np.asarray([ex[d] for ex in examples], dtype=np.float32), "FP32"))
    return out


def _columns(tensors: list[tuple[str, np.ndarray, str]]) -> dict[str, list[Any]]:
    """The columnar /v1 form of the v2 tensors: one JSON list per input."""
    return {name: array.tolist() for name, array, _ in tensors}


def _v2_body(tensors: list[tuple[str, np.ndarray, str]]) -> tuple[bytes, dict[str, str]]:
    """A v2 REST infer body of `tensors` in binary tensor data, as tritonclient sends it."""
    import tritonclient.http as triton_http

    inputs = []
    for name, array, datatype in tensors:
        tensor = triton_http.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=True)
        inputs.append(tensor)
    outputs = [triton_http.InferRequestedOutput("score", binary_data=True)]
    body, json_size = triton_http.InferenceServerClient.generate_request_body(inputs, outputs)
    headers = {"Content-Type": "application/octet-stream"}
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    return bytes(body), headers


def _loads(
    server: ChildServer,
    naive_port: int,
    seconds: int,
    examples: list[dict[str, Any]],
    tensors: list[tuple[str, np.ndarray, str]],
    v2_body: bytes,
    v2_headers: dict[str, str],
) -> dict[str, Any]:
    """Each HTTP arm under wrk posting `examples` (as `tensors`, as `v2_body`) over
    `CONNECTIONS` connections (see the module docstring); {"skipped": why} without wrk."""
    if not have_wrk():
        log("endpoint: wrk is not installed (apt-get install wrk): no throughput phase")
        return {"skipped": "wrk is not installed"}
    json_headers = {"Content-Type": "application/json"}
    bodies = {
        "naive": (
            f"http://127.0.0.1:{naive_port}/predict",
            json.dumps({"examples": examples}).encode(),
            json_headers,
        ),
        "v1": (
            f"{server.url}/v1/predict",
            json.dumps({"examples": examples}).encode(),
            json_headers,
        ),
        "v1 columns": (
            f"{server.url}/v1/predict",
            json.dumps({"columns": _columns(tensors)}).encode(),
            json_headers,
        ),
        "v2 http": (f"{server.url}/v2/models/{MODEL}/infer", v2_body, v2_headers),
    }
    loads: dict[str, Any] = {"batch": LOAD_BATCH, "connections": CONNECTIONS, "seconds": seconds}
    for arm in LOADED:
        url, body, headers = bodies[arm]
        log(f"endpoint: wrk on {arm}, {CONNECTIONS} connections, {seconds} s")
        load = wrk_load(url, body, headers, connections=CONNECTIONS, seconds=seconds)
        assert load is not None
        loads[arm] = load.as_dict()
    naive_rate = loads["naive"]["requests_per_s"]
    loads["vs_naive"] = {
        arm: round(loads[arm]["requests_per_s"] / naive_rate, 2) if naive_rate else None
        for arm in LOADED
    }
    return loads


def _timed(call: Callable[[], object], n: int) -> dict[str, float]:
    """p50/p99 (and max, mean) of `n` sequential calls after a warm-up."""
    for _ in range(max(3, n // 10)):  # warm: connections, first allocations
        call()
    seconds = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return percentiles(seconds)


def _print(doc: dict[str, Any], batches: tuple[int, ...]) -> None:
    arms = doc["arms"]
    print(f"sequential requests, {doc['requests']} per arm and batch: p50 ms (p99) [x forward]")
    print(f"{'arm':<10}" + "".join(f"{f'batch {b}':>26}" for b in batches))
    for arm in ARMS:
        cells = [
            f"{arms[arm][str(b)]['p50_ms']:.2f} ({arms[arm][str(b)]['p99_ms']:.2f}) "
            f"[{doc['vs_forward_p50'][arm][str(b)]}x]"
            for b in batches
        ]
        print(f"{arm:<10}" + "".join(f"{c:>26}" for c in cells))
    _print_workers(doc["workers"])
    load = doc["load"]
    if "skipped" in load:
        print(f"throughput: skipped ({load['skipped']})")
        return
    print(
        f"throughput at batch {load['batch']}, wrk, {load['connections']} connections, "
        f"{load['seconds']} s: requests/s [x naive], p50 / p99 ms, failed"
    )
    for arm in LOADED:
        got = load[arm]
        print(
            f"{arm:<10}{got['requests_per_s']:>10.0f} [{load['vs_naive'][arm]}x]"
            f"{got['p50_ms']:>10.2f} / {got['p99_ms']:.2f}{got['failed']:>8}"
        )


def _print_workers(workers: dict[str, Any]) -> None:
    if "skipped" in workers:
        print(f"--workers: skipped ({workers['skipped']})")
        return
    print(
        f"serve --workers N, v2 http at batch {LOAD_BATCH}, wrk {CONNECTIONS} connections, "
        f"{workers['seconds']} s: idle and while a {workers['delta_rows']}-row delta commits "
        "every second"
    )
    for n in ("1", "2"):
        got = workers[n]
        idle, busy = got["idle"], got["applying"]
        print(
            f"workers {n}: {idle['requests_per_s']:.0f} req/s, p99 {idle['p99_ms']:.2f} ms idle, "
            f"{busy['p99_ms']:.2f} ms applying [{got['p99_applying_vs_idle']}x], failed "
            f"{idle['failed'] + busy['failed']}, {got['deltas_committed']} deltas, "
            f"PSS {got['pss_bytes'] / 2**20:.0f} MiB"
        )
    print(
        f"2 workers vs 1: throughput {workers['throughput_2_vs_1']}x, memory (PSS) "
        f"{workers['pss_2_vs_1']}x"
    )


def _throughput_bars(doc: dict[str, Any]) -> dict[str, float]:
    """requests/s per loaded arm and per worker count, when wrk ran."""
    load, workers = doc.get("load", {}), doc.get("workers", {})
    if "skipped" in load or "skipped" in workers or not load:
        return {}
    bars = {arm: float(load[arm]["requests_per_s"]) for arm in LOADED}
    for n in ("1", "2"):
        bars[f"v2 http, --workers {n}"] = float(workers[n]["idle"]["requests_per_s"])
    return bars


def plot(doc: dict[str, Any], path: Path) -> None:
    """p50 per arm and batch, log scale; beside it, throughput per arm when wrk ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = doc["arms"]
    batches = list(arms["forward"])
    throughput = _throughput_bars(doc)
    fig, axes = plt.subplots(1, 2 if throughput else 1, figsize=(13 if throughput else 8, 4))
    ax = axes[0] if throughput else axes
    width = 0.8 / len(ARMS)
    for i, arm in enumerate(ARMS):
        xs = [j + i * width for j in range(len(batches))]
        ax.bar(xs, [arms[arm][b]["p50_ms"] for b in batches], width, label=arm)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))])
    ax.set_xticklabels([f"batch {b}" for b in batches])
    ax.set_yscale("log")
    ax.set_ylabel("p50 latency (ms), sequential")
    ax.set_title(f"one answer, each way in ({doc['machine'].get('cpu_model', 'CPU')})")
    ax.legend(fontsize=8)
    if throughput:
        right = axes[1]
        names = list(throughput)
        right.barh(names, [throughput[n] for n in names], color="tab:purple")
        right.invert_yaxis()
        right.set_xlabel(f"requests/s at batch {LOAD_BATCH}, wrk, {CONNECTIONS} connections")
        right.set_title("throughput")
        for y, n in enumerate(names):
            right.text(throughput[n], y, f" {throughput[n]:,.0f}", va="center", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
