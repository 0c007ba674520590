"""`checknrun bench serving freshness` under predict load: the load it drives and the stages it
reports (shapes and counts, never speeds)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bench.cli import main
from bench.predict_load import PredictLoad
from bench.serving import FRESHNESS_STAGES


class Answers(BaseHTTPRequestHandler):
    """200 to a POST /v1/predict carrying the expected body, 500 to anything else."""

    body = b'{"examples": []}'
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn: one connection per client

    def do_POST(self) -> None:
        got = self.rfile.read(int(self.headers["Content-Length"]))
        ok = self.path == "/v1/predict" and got == self.body
        self.send_response(200 if ok else 500)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: object) -> None:
        pass


class Backlogged(ThreadingHTTPServer):
    """A listen backlog for every client at once (socketserver's default of 5 resets some)."""

    request_queue_size = 64


@pytest.fixture
def server_url() -> Iterator[str]:
    with Backlogged(("127.0.0.1", 0), Answers) as httpd:
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
        httpd.shutdown()


def test_predict_load_posts_the_body_to_every_server(server_url: str) -> None:
    load = PredictLoad([server_url, server_url], Answers.body, rate=50.0)
    load.start()
    threading.Event().wait(0.3)
    figures = load.stop()
    assert figures["servers"] == 2 and figures["rate_per_server"] == 50.0
    assert figures["requests"] >= 2 and figures["statuses"] == {"200": figures["requests"]}
    assert figures["p50_ms"] <= figures["p99_ms"] <= figures["max_ms"]


def test_predict_load_counts_failed_requests(server_url: str) -> None:
    load = PredictLoad([server_url], b"not the body", rate=50.0)
    load.start()
    threading.Event().wait(0.2)
    figures = load.stop()
    assert figures["statuses"] == {"500": figures["requests"]} and "p50_ms" not in figures


def test_predict_load_refuses_a_rate_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="rate"):
        PredictLoad(["http://127.0.0.1:9"], b"", rate=0.0)


def test_freshness_under_load_reports_every_stage(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    argv = ["serving", "freshness", "--quick", "--versions", "3", "--load-rate", "10"]
    assert main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["never_seen"] == 0 and doc["servers"] == 1
    load = doc["predict_load"]
    assert load["rate_per_server"] == 10.0 and load["requests"] > 0
    assert load["statuses"] == {"200": load["requests"]}
    assert list(doc["stages"]) == list(FRESHNESS_STAGES)
    assert all(doc["stages"][name]["n"] == 3 for name in ("encode", "upload", "commit"))
    # Server-side stages need the watcher to see each version served (it polls every 5 ms).
    assert all(doc["stages"][name]["n"] >= 1 for name in FRESHNESS_STAGES)
    rows = doc["per_version"]
    assert [row["version"] for row in rows] == [2, 3, 4]
    assert all(row["served"] >= row["encode"] for row in rows)
