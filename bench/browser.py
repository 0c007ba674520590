"""A real headless browser (Debian's Chromium) looking at a page: its DOM after load, and a PNG.

    dom = dump_dom("http://127.0.0.1:8000/status")
    screenshot("http://127.0.0.1:8000/status", Path("docs/benchmarks/status.png"))

`scripts/setup.sh` installs `chromium` where it may (root with apt); `chromium_path()` is None
without it. Each call runs one Chromium process with a profile directory of its own, no
sandbox (CI runs as root, where Chromium refuses its sandbox), no GPU, and a timeout.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

#: the executables Debian and others name Chromium by.
NAMES = ("chromium", "chromium-browser", "google-chrome")
TIMEOUT_S = 60.0


class BrowserError(RuntimeError):
    """Chromium is missing, failed, or did not finish in time (its output quoted)."""


def chromium_path() -> str | None:
    """The Chromium executable on PATH, or None."""
    return next((p for name in NAMES if (p := shutil.which(name)) is not None), None)


def _run(url: str, flags: list[str]) -> bytes:
    binary = chromium_path()
    if binary is None:
        raise BrowserError(f"no Chromium on PATH (one of {', '.join(NAMES)}): apt install chromium")
    with tempfile.TemporaryDirectory(prefix="checknrun-chromium-") as profile:
        argv = [
            binary,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            f"--user-data-dir={profile}",
            *flags,
            url,
        ]
        try:
            done = subprocess.run(
                argv, capture_output=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise BrowserError(f"Chromium did not finish {url} in {TIMEOUT_S:.0f} s") from exc
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace")[-1500:]
        raise BrowserError(f"Chromium exited {done.returncode} on {url}: {tail}")
    return done.stdout


def dump_dom(url: str) -> str:
    """The page's DOM as Chromium serialises it once loaded."""
    return _run(url, ["--dump-dom"]).decode()


def screenshot(url: str, out: Path, width: int = 1100, height: int = 1500) -> Path:
    """A PNG of the page's first `width` x `height` pixels, written to `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    _run(url, [f"--screenshot={out.resolve()}", f"--window-size={width},{height}"])
    if not out.is_file() or out.stat().st_size == 0:
        raise BrowserError(f"Chromium wrote no screenshot of {url} to {out}")
    return out
