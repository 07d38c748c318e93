"""The overhead benchmark's load generators, each in a client process of its own (one per server).

A client process runs one cell at a time: `vllm bench serve` (vLLM's client, in-process) or ours
(loadtests.streaming_client's request, in the same closed loop). Keeping the clients out of the process
that starts the servers and samples their CPU lets two servers be loaded at the same time without their
clients sharing one interpreter (and its GIL).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import httpx

from loadtests import vllm_bench
from loadtests.overhead_matrix import VLLM_BENCH
from loadtests.streaming_client import RequestResult, one_request, percentile, prompts
from loadtests.vllm_bench import Workload


def our_prompts(workload: Workload, num_prompts: int, seed: int) -> list[str]:
    """Our client's prompts for a cell: about `input_len` words each (about a token per word with the
    Qwen tokenizers), behind the cell's shared prefix if the workload has one. The seed leads every
    prompt, so no cell or round reuses another's cached prefix, and the prefix is shared within a cell."""
    lead = f"Run {seed}."
    if workload.prefix_len:
        lead += " " + prompts(1, workload.prefix_len)[0]
    return [f"{lead} {p}" for p in prompts(num_prompts, workload.input_len)]


async def our_cell(
    base_url: str, model: str, workload: Workload, concurrency: int, num_prompts: int, seed: int
) -> dict[str, Any]:
    """`concurrency` workers, each sending its next request when its previous one finished."""
    url = base_url.rstrip("/") + "/v1/completions"
    queue = our_prompts(workload, num_prompts, seed)[::-1]
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            while queue:
                results.append(await one_request(client, url, model, queue.pop(), workload.output_len))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration_s = time.perf_counter() - start
    tokens = sum(r.output_tokens for r in results)
    return {
        "ttft_p50_ms": percentile([r.ttft_s for r in results], 50) * 1000,
        "ttft_p99_ms": percentile([r.ttft_s for r in results], 99) * 1000,
        "tpot_p50_ms": percentile([r.tpot_s for r in results if r.tpot_s is not None], 50) * 1000,
        "itl_p50_ms": None,
        "e2e_p50_ms": percentile([r.e2e_s for r in results], 50) * 1000,
        "output_tokens_per_s": tokens / duration_s,
        "requests_per_s": len(results) / duration_s,
        "duration_s": duration_s,
        "completed": len(results),
        "total_output_tokens": tokens,
    }


def measure(job: dict[str, Any]) -> dict[str, Any]:
    """One cell against one server. job: `client`; for vLLM's client `argv` and optionally `delay_s` (its
    wait before each request); for ours `base_url`, `model`, `workload` (Workload's fields), `concurrency`,
    `num_prompts`, `seed`."""
    if job["client"] == VLLM_BENCH:
        return vllm_bench.from_result(vllm_bench.run(job["argv"], job.get("delay_s", 0.0)))
    w = Workload(**job["workload"])
    return asyncio.run(
        our_cell(job["base_url"], job["model"], w, job["concurrency"], job["num_prompts"], job["seed"])
    )


def _serve_jobs(conn: Connection, log_path: str) -> None:
    # vLLM's client prints its arguments and a table per run: into the client's log, not the console.
    with open(log_path, "a") as log, contextlib.redirect_stdout(log):
        while True:
            job = conn.recv()
            if job is None:
                return
            try:
                conn.send(("ok", measure(job)))
            except Exception:  # the parent raises it with this traceback
                conn.send(("error", traceback.format_exc()))


class ClientProcess:
    """A spawned process that runs the jobs sent to it, one at a time (it imports vLLM's client once)."""

    def __init__(self, name: str, log_path: Path):
        self.name = name
        self.conn, child = multiprocessing.get_context("spawn").Pipe()
        self.process = multiprocessing.get_context("spawn").Process(
            target=_serve_jobs, args=(child, str(log_path)), name=f"client-{name}", daemon=True
        )
        self.process.start()

    def submit(self, job: dict[str, Any]) -> None:
        self.conn.send(job)

    def result(self) -> dict[str, Any]:
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"client {self.name} failed:\n{value}")
        return value

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        self.submit(job)
        return self.result()

    def close(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(timeout=10)


def results_as_completed(clients: list[ClientProcess]):
    """Yields (client, result) for clients that were each sent one job, in the order they finish."""
    pending = {c.conn: c for c in clients}
    while pending:
        for conn in wait(list(pending)):
            client = pending.pop(conn)  # type: ignore[index]
            yield client, client.result()
