"""Finding a Serve application's processes on this machine, for the benchmarks' CPU and memory sampling."""

from __future__ import annotations

import psutil


def serve_replicas(app_name: str) -> list[psutil.Process]:
    """The replica actors of `app_name` (Ray titles them `ray::ServeReplica:<app>:<deployment>`); their
    children are the vLLM engine processes."""
    prefix = f"ray::ServeReplica:{app_name}:"
    return [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0].startswith(prefix)]
