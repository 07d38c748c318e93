"""One vLLM engine, simulated step by step: continuous batching, chunked prefill, sequence and KV limits.

Each step, as vLLM's v1 scheduler does it: every decoding sequence gets one token; then prompt tokens fill
the rest of the step's token budget (``max_num_batched_tokens``), first those of requests already being
prefilled, then new requests from the waiting queue in arrival order, while fewer than ``max_num_seqs``
run and the KV cache holds the request's prompt and output. A request whose prompt completes in a step
gets its first token at the end of that step (TTFT), then one token per step until its output is done.
Step time follows :class:`~autoscale.calibration.EngineCost`.

Decode-only stretches (nothing to prefill) are not stepped one by one: the engine jumps to the next
finish or to the next time it is asked about, adding the same steps, tokens and busy time. The KV check
reserves a request's prompt and output at admission (vLLM admits on the prompt and preempts when the cache
fills; with the plan's max_num_seqs the cache holds every sequence at max_model_len, so neither binds).

The engine counts what the real replica's stat logger counts (autoscale/replica_stats.py) into the same
``EngineStats`` and ``ReplicaStatsWindow``, so the policy reads the same report in replay as live.
Pure Python, written for speed: the benchmark replays millions of requests.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from heapq import heappop, heappush

from autoscale.calibration import EngineCost, EngineLimits
from autoscale.replica_stats import LIGHT_DECODE_BATCH, ReplicaStatsWindow

__all__ = ["ReplicaEngine", "Requests"]


@dataclass(eq=False)
class Requests:
    """Every request of a run, indexed by request id; the engines write ``ttft_ms`` and ``failed``."""

    arrival_s: list[float]
    prompt_tokens: list[int]
    output_tokens: list[int]
    ttft_ms: list[float]
    failed: list[bool]
    finished_s: list[float]
    """When the engine produced each request's last token (nan: not finished)."""
    sent_s: list[float]
    """When each request's latest attempt reached a replica: a refused request is sent again later, and
    the replica times its first token from there (the client from ``arrival_s``)."""
    attempts: list[int]
    """Attempts refused so far (see :class:`~autoscale.calibration.Admission`)."""

    @classmethod
    def create(cls, arrival_s: list[float], prompt_tokens: list[int], output_tokens: list[int]) -> Requests:
        n = len(arrival_s)
        if not len(prompt_tokens) == len(output_tokens) == n:
            raise ValueError("arrival_s, prompt_tokens and output_tokens must have one entry per request")
        nan = [math.nan] * n
        return cls(
            arrival_s, prompt_tokens, output_tokens, nan, [False] * n, list(nan), list(arrival_s), [0] * n
        )


class ReplicaEngine:
    """One engine; :meth:`advance` runs it up to a time, :meth:`submit` hands it a request."""

    __slots__ = (
        "_cost",
        "_limits",
        "_req",
        "_remaining",
        "window",
        "clock",
        "waiting",
        "_prefilling",
        "_decoding",
        "n_admitted",
        "n_decoding",
        "_step_no",
        "_context_tokens",
        "_kv_reserved",
        "ongoing",
    )

    def __init__(
        self,
        cost: EngineCost,
        limits: EngineLimits,
        requests: Requests,
        window: ReplicaStatsWindow,
        start_s: float,
    ) -> None:
        self._cost, self._limits, self._req, self.window = cost, limits, requests, window
        self._remaining: dict[int, int] = {}
        self.clock = start_s
        self.waiting: deque[int] = deque()
        self._prefilling: deque[int] = deque()
        self._decoding: list[tuple[int, int]] = []  # heap of (last step, request id)
        self.n_admitted = 0
        self.n_decoding = 0
        self._step_no = 0
        self._context_tokens = 0
        self._kv_reserved = 0
        self.ongoing = 0
        """Requests at this replica (waiting and running): what Serve's router balances on."""

    def submit(self, rid: int, now_s: float) -> None:
        """A request arrives (call :meth:`advance` to ``now_s`` first: it joins the next step)."""
        self.waiting.append(rid)
        self.ongoing += 1
        self.window.request_arrived(now_s)

    def advance(self, until_s: float) -> None:
        """Runs every step that starts before ``until_s``; an idle engine waits until then."""
        clock = self.clock
        if clock >= until_s:
            return
        while clock < until_s:
            if self._prefilling or (self.waiting and self._admissible()):
                clock = self._mixed_step(clock)
            elif self.n_decoding:
                clock = self._decode_stretch(clock, until_s)
            else:
                clock = until_s
        self.clock = clock

    def step(self) -> bool:
        """Runs one step, or a decode-only stretch to the next finish; False when there is nothing to do."""
        if self._prefilling or (self.waiting and self._admissible()):
            self.clock = self._mixed_step(self.clock)
        elif self.n_decoding:
            self.clock = self._decode_stretch(self.clock, math.inf)
        else:
            return False
        return True

    def publish_scheduler_state(self) -> None:
        """Copies the scheduler's numbers into the stats (as vLLM's stat logger does every step)."""
        stats = self.window.engine
        stats.num_running, stats.num_waiting = self.n_admitted, len(self.waiting)
        stats.kv_cache_usage = min(1.0, self._kv_reserved / self._limits.kv_cache_tokens)

    def in_flight(self) -> list[int]:
        """The requests this engine holds (waiting, prefilling, decoding)."""
        return [*self.waiting, *self._prefilling, *(rid for _, rid in self._decoding)]

    def _admissible(self) -> bool:
        rid = self.waiting[0]
        need = self._req.prompt_tokens[rid] + self._req.output_tokens[rid]
        lim = self._limits
        return self.n_admitted < lim.max_num_seqs and self._kv_reserved + need <= lim.kv_cache_tokens

    def _schedule_prefill(self, budget: int, first: list[int]) -> int:
        """Fills ``budget`` with prompt tokens (running prefills first, then admissions); returns how many.
        Requests whose prompt completes are appended to ``first``."""
        rem, pre, wait, req, lim = self._remaining, self._prefilling, self.waiting, self._req, self._limits
        scheduled = 0
        while pre and budget > 0:
            rid = pre[0]
            left = rem[rid]
            take = min(left, budget)
            budget -= take
            scheduled += take
            if take == left:
                pre.popleft()
                del rem[rid]
                first.append(rid)
            else:
                rem[rid] = left - take
        while wait and budget > 0 and self.n_admitted < lim.max_num_seqs:
            rid = wait[0]
            prompt = req.prompt_tokens[rid]
            need = prompt + req.output_tokens[rid]
            if self._kv_reserved + need > lim.kv_cache_tokens:
                break
            wait.popleft()
            self.n_admitted += 1
            self._kv_reserved += need
            take = min(prompt, budget)
            budget -= take
            scheduled += take
            if take == prompt:
                first.append(rid)
            else:
                rem[rid] = prompt - take
                pre.append(rid)
        return scheduled

    def _mixed_step(self, clock: float) -> float:
        cost, d = self._cost, self.n_decoding
        first: list[int] = []
        prefill = self._schedule_prefill(self._limits.max_num_batched_tokens - d, first)
        duration_ms = (
            cost.step_ms
            + cost.prefill_ms_per_token * prefill
            + cost.decode_ms_per_seq * d
            + cost.attention_ms_per_kv_token * self._context_tokens
        )
        end = clock + duration_ms / 1000.0
        step = self._step_no
        self._context_tokens += d
        heap = self._decoding
        if heap and heap[0][0] <= step:
            self._finish_through(step, end)
        req, window = self._req, self.window
        for rid in first:
            req.ttft_ms[rid] = (end - req.arrival_s[rid]) * 1000.0 + cost.request_overhead_ms
            window.first_token(end, (end - req.sent_s[rid]) * 1000.0 + cost.request_overhead_ms)
            n_out = req.output_tokens[rid]
            self.n_decoding += 1
            self._context_tokens += req.prompt_tokens[rid] + 1
            heappush(heap, (step + n_out - 1, rid))
        self._step_no = step + 1
        stats = window.engine
        stats.steps += 1
        stats.busy_s += duration_ms / 1000.0
        stats.prompt_tokens += prefill
        stats.generation_tokens += d + len(first)
        # Requests of one output token finish in the step that prefilled them.
        if heap and heap[0][0] <= step:
            self._finish_through(step, end)
        return end

    def _decode_stretch(self, clock: float, until_s: float) -> float:
        cost, d, ctx = self._cost, self.n_decoding, self._context_tokens
        base_ms = cost.step_ms + cost.decode_ms_per_seq * d + cost.attention_ms_per_kv_token * ctx
        k_finish = self._decoding[0][0] - self._step_no + 1
        k = k_finish
        if until_s < math.inf:
            k = min(k, max(1, math.ceil((until_s - clock) * 1000.0 / base_ms)))
        total_ms = k * base_ms + cost.attention_ms_per_kv_token * d * k * (k - 1) / 2.0
        end = clock + total_ms / 1000.0
        stats = self.window.engine
        if d <= LIGHT_DECODE_BATCH:
            stats.observe_decode_floor(base_ms)
        stats.steps += k
        stats.busy_s += total_ms / 1000.0
        stats.generation_tokens += k * d
        self._step_no += k
        self._context_tokens += k * d
        self._finish_through(self._step_no - 1, end)
        return end

    def _finish_through(self, step: int, end: float) -> None:
        heap, req = self._decoding, self._req
        while heap and heap[0][0] <= step:
            _, rid = heappop(heap)
            req.finished_s[rid] = end
            n = req.prompt_tokens[rid] + req.output_tokens[rid]
            self.n_decoding -= 1
            self.n_admitted -= 1
            self._context_tokens -= n
            self._kv_reserved -= n
            self.ongoing -= 1
            self.window.engine.finished += 1
