"""Milliseconds per request of the event-loop thread in each py-spy profile (raw format, 250 Hz), by frame.

    python results/gpu/2026-12-02d/cpu-profile/per_request.py

Each frame's samples (inclusive) / 250 Hz / requests served while py-spy recorded (12 s x the run's
request rate from `vllm bench serve`: 160.96 req/s against headroom, 203.74 against `vllm serve`).
"""

import collections
import gzip
from pathlib import Path

HERE = Path(__file__).parent
RATE_HZ, SECONDS = 250, 12
PROFILES = {  # file, the event loop's thread, requests per second in that run
    "headroom": ("headroom-replica.raw.gz", "AsyncIO Thread", 160.96),
    "vllm": ("vllm-api-server.raw.gz", "MainThread", 203.74),
}
SHOWN = (
    "FastAPI.__call__",
    "Metric._record",
    "StatLoggerManager.record",
    "Replica._direct_ingress_asgi",
    "ReplicaASGI.__call__",
    "RequestResponseCycle.send",
)


def per_request_ms(name: str, thread: str, rps: float) -> tuple[float, dict[str, float]]:
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    with gzip.open(HERE / name, "rt") as profile:
        for line in profile:
            stack, _, count = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            if thread not in frames[0]:
                continue
            total += int(count)
            for frame in {f.split(" (")[0] for f in frames[1:]}:
                inclusive[frame] += int(count)
    scale = 1000 / RATE_HZ / (rps * SECONDS)
    return total * scale, {f: c * scale for f, c in inclusive.items()}


if __name__ == "__main__":
    rows = {server: per_request_ms(*spec) for server, spec in PROFILES.items()}
    print("ms per request      " + "  ".join(f"{s:>9}" for s in rows))
    print("event loop, busy    " + "  ".join(f"{t:9.2f}" for t, _ in rows.values()))
    for frame in SHOWN:
        cells = "  ".join(f"{frames.get(frame, 0.0):9.3f}" for _, frames in rows.values())
        print(f"{frame[:19]:<19} {cells}")
