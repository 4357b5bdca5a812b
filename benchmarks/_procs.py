"""Process handling shared by the benchmark scripts that start their own ranks."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable

__all__ = ["stop_ranks"]


def stop_ranks(procs: Iterable[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM every rank still running, then SIGKILL any that outlive ``grace`` seconds."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
