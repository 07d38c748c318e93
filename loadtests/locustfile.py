"""Locust users for OpenAI-compatible LLM servers (headroom, `vllm serve`, or any other): streaming chat or
completions, with TTFT, TPOT, inter-token gaps, e2e latency and output tokens per request.

    locust -f loadtests/locustfile.py --headless -u 8 -r 8 -t 60s --host http://127.0.0.1:8000 \\
        --model tiny-qwen3 --profile structured --max-tokens 64 --csv results/run --raw-file results/raw.jsonl
    python -m loadtests.raw_stats results/raw.jsonl          # exact percentiles, per ladder step

Options (Locust's --help lists only its own; environment variables in brackets):
  --profile P         workload: random | shared-prefix | multi-turn | structured | creative (default
                      random) [HEADROOM_PROFILE]; Locust's own --profile, which labels its reports too
  --api A             chat (default) | completions [HEADROOM_API]
  --model M           served model name; default: the first of the server's /v1/models [HEADROOM_MODEL]
  --max-tokens N      override the profile's max_tokens [HEADROOM_MAX_TOKENS]
  --seed S            workload and arrival seed, default 0 [HEADROOM_SEED]
  --raw-file PATH     per-request JSONL (below) [HEADROOM_RAW_FILE]
  --ignore-eos B      send vLLM's ignore_eos (default true: every request generates max_tokens)
  --tokens-per-word X prompt sizing, default 1.3; `auto` asks vLLM's /tokenize (tiny-qwen3: ~4.4)
  --input-tokens N    random's prompt length; --prefix-tokens N: shared-prefix's system prompt length
                      [HEADROOM_PREFIX_TOKENS]
  --request-timeout S read timeout (default 600); --api-key K [OPENAI_API_KEY]; --extra-body JSON
  --ladder, --arrival-rate, --burstiness, --max-in-flight: the load shape (loadtests/shapes.py):
                      `--ladder 1:30,4:30,16:30` (closed-loop concurrency steps) or
                      `--arrival-rate 2:60 [--burstiness 0.5] [--max-in-flight 64]` (open loop);
                      neither: Locust's -u/-r/-t.

Definitions (the same as loadtests/streaming_client.py and `vllm bench serve`):
- TTFT: from just before the request is sent to the first streamed chunk that carries generated text
  (content; for chat also reasoning or tool-call deltas). vLLM's first chat chunk, the role with empty
  content, does not count.
- e2e: from the same start to the end of the stream (`data: [DONE]`).
- output tokens: `usage.completion_tokens` of the server's final chunk (`stream_options.include_usage`);
  a server that sends no usage falls back to the number of chunks with text (`tokens_from: "chunks"`).
- TPOT: (e2e - TTFT) / (output tokens - 1), for requests with at least 2 output tokens.
- inter-token gaps (ITL): gaps between consecutive chunks with text, per request their mean and max. With
  speculative decoding one chunk can carry several tokens, so gaps can exceed TPOT.

Per request this file fires Locust request events, so they show in Locust's stats, CSV and charts: the
POST itself (response time = e2e; a failure if the status is not 200, the stream breaks, or it carries
an error or no text) and, for successful requests, custom rows of type TTFT, TPOT, ITL (mean gap), ITL_MAX
and TOKENS (response time field = output tokens), named by profile. Their values are in ms, as Locust's
are, and Locust rounds them (to 2 significant digits above 100); the Aggregated row mixes all types, so
read request counts off the POST row. Exact percentiles come from the raw file.

Raw file: `--raw-file PATH` [HEADROOM_RAW_FILE], default `<--csv prefix>_raw.jsonl` when --csv is given.
One JSON object per line, appended per finished request (requests cut off by a hard stop are not
written). Fields: run (id of this Locust run), profile, api, model, user (user index), seq (the user's
request number), request_id, kind, conversation, turn, step and step_index (ladder or arrival-rate step,
else null), users (running users at send), start_s (wall-clock epoch seconds at send), scheduled_s and
send_lag_s (open loop: the arrival's scheduled time and how late it left; else null), ttft_s, tpot_s,
e2e_s, itl_mean_s, itl_max_s, chunks, output_tokens, prompt_tokens (from usage), tokens_from
(usage|chunks), status (HTTP status; 0: no response), error (null on success).

Determinism: every user draws from its own request stream, `workloads.iter_requests(profile, seed,
stream=user index)` (user index = order of start, plus worker index x 100000 in distributed runs), so
what user k sends as its i-th request depends only on the seed; how many requests a closed-loop run
gets through depends on the server. Open loop: one shared stream, arrival k carries request k, and the
schedule comes from the seed. Per-request sampling seeds are sent too.

Stopping: in-flight requests are allowed to finish when a test stops (a cut-off stream would be missing
from the raw file yet counted by the server, and the slowest requests would be dropped from the tail):
unless --stop-timeout is given, it is set to --request-timeout.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import requests
from locust import HttpUser, events, task
from locust.runners import MasterRunner, WorkerRunner
from locust.stats import CSV_STATS_INTERVAL_SEC

try:
    from loadtests import shapes, workloads
    from loadtests.shapes import HeadroomShape  # noqa: F401  (Locust runs the shape class it finds here)
except ImportError:  # copied next to its sibling modules, outside the package
    import shapes  # type: ignore[no-redef]
    import workloads  # type: ignore[no-redef]
    from shapes import HeadroomShape  # type: ignore[no-redef]  # noqa: F401

log = logging.getLogger("headroom.locust")

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
WORKER_USER_STRIDE = 100_000
CONNECT_ERROR_PAUSE_S = 1.0


def _bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    group = parser.add_argument_group("headroom LLM workload")
    group.add_argument(
        "--model",
        default=None,
        env_var="HEADROOM_MODEL",
        help="Served model name (default: the server's first)",
    )
    group.add_argument(
        "--api", default="chat", choices=tuple(PATHS), env_var="HEADROOM_API", help="chat or completions"
    )
    group.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        env_var="HEADROOM_MAX_TOKENS",
        help="Override the profile's max_tokens",
    )
    group.add_argument("--seed", type=int, default=0, env_var="HEADROOM_SEED", help="Workload seed")
    group.add_argument(
        "--raw-file",
        default=None,
        env_var="HEADROOM_RAW_FILE",
        help="Per-request JSONL, appended (default: <--csv prefix>_raw.jsonl)",
    )
    group.add_argument(
        "--ignore-eos",
        type=_bool,
        default=True,
        env_var="HEADROOM_IGNORE_EOS",
        help="Send vLLM's ignore_eos, so every request generates max_tokens (false for servers without it)",
    )
    group.add_argument(
        "--tokens-per-word",
        default=str(workloads.DEFAULT_TOKENS_PER_WORD),
        env_var="HEADROOM_TOKENS_PER_WORD",
        help="Prompt sizing: tokens per word of the server's tokenizer, or 'auto' (ask vLLM's /tokenize)",
    )
    group.add_argument(
        "--input-tokens",
        type=int,
        default=workloads.DEFAULT_INPUT_TOKENS,
        help="random: prompt length, tokens",
    )
    group.add_argument(
        "--prefix-tokens",
        type=int,
        default=workloads.DEFAULT_PREFIX_TOKENS,
        env_var="HEADROOM_PREFIX_TOKENS",
        help="shared-prefix: system prompt length, tokens",
    )
    group.add_argument(
        "--request-timeout", type=float, default=600.0, help="Seconds a request may take (read timeout)"
    )
    group.add_argument(
        "--api-key", default=None, env_var="OPENAI_API_KEY", help="Bearer token, if the server wants one"
    )
    group.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    shapes.add_arguments(parser)


# --------------------------------------------------------------------------------------------------------
# Per-process run state: options resolved once, the raw file, the open-loop schedule
# --------------------------------------------------------------------------------------------------------


@dataclass
class _Slot:
    arrival: workloads.Arrival
    request: dict[str, Any]
    due: float  # perf_counter time
    scheduled_s: float  # wall clock


class ArrivalClock:
    """The open-loop schedule shared by this process's users: claim() hands out arrivals in order."""

    def __init__(self, arrivals: list[workloads.Arrival], requests_stream: Iterator[dict[str, Any]]):
        self.arrivals = arrivals
        self._requests = requests_stream
        self._next = 0
        self._t0: float | None = None
        self._wall0 = 0.0

    def claim(self) -> _Slot | None:
        if self._t0 is None:  # the clock starts with the first claim, once users exist
            self._t0, self._wall0 = time.perf_counter(), time.time()
        if self._next >= len(self.arrivals):
            return None
        a = self.arrivals[self._next]
        self._next += 1
        return _Slot(a, next(self._requests), self._t0 + a.at_s, self._wall0 + a.at_s)


class _Run:
    def __init__(self) -> None:
        self.active = False
        self.id = ""
        self.model = ""
        self.raw: TextIO | None = None
        self.clock: ArrivalClock | None = None
        self.rate_steps: list[workloads.Step] = []
        self.workload: dict[str, Any] = {}
        self.users = itertools.count()
        self.extra_body: dict[str, Any] = {}

    def write(self, record: dict[str, Any]) -> None:
        if self.raw is not None:
            self.raw.write(json.dumps(record) + "\n")  # one write per line: whole lines, even when appending
            self.raw.flush()  # from several processes


RUN = _Run()


def _base_url(environment: Any) -> str:
    if not environment.host:
        raise ValueError("no --host given: the server's base URL, e.g. http://127.0.0.1:8000")
    return environment.host.rstrip("/")


def _resolve_model(environment: Any, headers: dict[str, str]) -> str:
    options = environment.parsed_options
    if options.model:
        return options.model
    response = requests.get(f"{_base_url(environment)}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    model = response.json()["data"][0]["id"]
    log.info("--model not given: using the server's first model, %s", model)
    return model


def _resolve_tokens_per_word(environment: Any, model: str, headers: dict[str, str]) -> float:
    """A number, or 'auto': tokens per word of this profile's prompts, measured with vLLM's /tokenize."""
    options = environment.parsed_options
    if str(options.tokens_per_word).strip().lower() != "auto":
        return float(options.tokens_per_word)
    sample = workloads.make_requests(options.profile, 8, options.seed)
    text = "\n".join(r["prompt"] for r in sample)
    response = requests.post(
        f"{_base_url(environment)}/tokenize",
        json={"model": model, "prompt": text, "add_special_tokens": False},
        headers=headers,
        timeout=30,
    )
    response.raise_for_status()
    ratio = round(response.json()["count"] / len(text.split()), 2)
    log.info("--tokens-per-word auto: %.2f tokens per word on %s", ratio, model)
    return ratio


def _headers(options: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}


@events.init.add_listener
def _on_init(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    if options is None:
        return
    # --profile is Locust's own option ("a profile to group test runs together"); here it names the
    # workload profile too, so Locust's reports carry it.
    options.profile = options.profile or os.environ.get("HEADROOM_PROFILE") or "random"
    if options.profile not in workloads.PROFILES:
        raise SystemExit(f"--profile {options.profile!r}: expected one of {', '.join(workloads.PROFILES)}")
    environment.profile = options.profile
    if options.ladder and options.arrival_rate:
        raise SystemExit("--ladder and --arrival-rate exclude each other: choose closed or open loop")
    for flag, spec in (("--ladder", options.ladder), ("--arrival-rate", options.arrival_rate)):
        if spec:
            try:
                workloads.parse_steps(spec)
            except ValueError as e:
                raise SystemExit(f"{flag}: {e}") from None
    try:
        json.loads(options.extra_body)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--extra-body: not JSON ({e})") from None
    if not options.stop_timeout and not isinstance(environment.runner, WorkerRunner):
        environment.stop_timeout = options.request_timeout
        log.info(
            "in-flight requests finish when the test stops (stop timeout %.0f s)", options.request_timeout
        )


@events.test_start.add_listener
def _on_test_start(environment: Any, **_: Any) -> None:
    if RUN.active or isinstance(environment.runner, MasterRunner):
        return
    options = environment.parsed_options
    headers = _headers(options)
    RUN.id = f"{time.strftime('%Y%m%dT%H%M%S')}-{options.profile}-s{options.seed}"
    RUN.model = _resolve_model(environment, headers)
    RUN.extra_body = json.loads(options.extra_body)
    RUN.workload = {
        "max_tokens": options.max_tokens,
        "tokens_per_word": _resolve_tokens_per_word(environment, RUN.model, headers),
        "input_tokens": options.input_tokens,
        "prefix_tokens": options.prefix_tokens,
    }
    RUN.users = itertools.count()
    path = options.raw_file or (f"{options.csv_prefix}_raw.jsonl" if options.csv_prefix else None)
    if path:
        RUN.raw = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the whole run)
        log.info("raw per-request records: %s (run %s)", path, RUN.id)
    else:
        log.warning("no --raw-file and no --csv: per-request records are not kept")
    RUN.clock = None
    if options.arrival_rate:
        if isinstance(environment.runner, WorkerRunner):
            raise ValueError("open loop (--arrival-rate) runs in one process: every worker would replay it")
        RUN.rate_steps = workloads.parse_steps(options.arrival_rate)
        arrivals = workloads.arrival_times(RUN.rate_steps, burstiness=options.burstiness, seed=options.seed)
        stream = workloads.iter_requests(options.profile, options.seed, stream=0, **RUN.workload)
        RUN.clock = ArrivalClock(arrivals, stream)
        log.info("open loop: %d arrivals scheduled, pool of %d users", len(arrivals), options.max_in_flight)
    RUN.active = True


@events.quitting.add_listener
def _on_quitting(environment: Any, **_: Any) -> None:
    # Locust rewrites its --csv stats once a second and does not write them again on exit: let it write
    # once more, so the CSV counts the requests that finished while the test was stopping.
    options = environment.parsed_options
    if options is not None and options.csv_prefix and not isinstance(environment.runner, WorkerRunner):
        time.sleep(CSV_STATS_INTERVAL_SEC + 0.25)


@events.test_stop.add_listener
def _on_test_stop(environment: Any, **_: Any) -> None:
    if RUN.raw is not None:
        RUN.raw.close()
        RUN.raw = None
    RUN.active = False


# --------------------------------------------------------------------------------------------------------
# The user
# --------------------------------------------------------------------------------------------------------


def _has_text(event: dict[str, Any], api: str) -> bool:
    choices = event.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    if api == "completions":
        return bool(choice.get("text"))
    delta = choice.get("delta") or {}
    return bool(
        delta.get("content")
        or delta.get("reasoning_content")
        or delta.get("reasoning")
        or delta.get("tool_calls")
    )


def _sse_lines(response: Any) -> Iterator[bytes]:
    """Lines of a streamed body as they arrive. Chunked transfer: each HTTP chunk as it comes; otherwise
    read1 (whatever the socket has), never a fixed-size read that would wait for more bytes."""
    raw = response.raw
    if getattr(raw, "chunked", False) or not hasattr(raw, "read1"):
        yield from response.iter_lines(chunk_size=None)
        return
    pending = b""
    while True:
        data = raw.read1(65536)
        if not data:
            break
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if pending:
        yield pending


class LLMUser(HttpUser):
    """One simulated client: streams a request, waits for its end, sends the next (closed loop), or, with
    --arrival-rate, sends at the times of the shared arrival schedule (open loop, shapes.py)."""

    def on_start(self) -> None:
        options = self.environment.parsed_options
        runner = self.environment.runner
        self.index = int(getattr(runner, "worker_index", 0) or 0) * WORKER_USER_STRIDE + next(RUN.users)
        self.stream = workloads.iter_requests(
            options.profile, options.seed, stream=self.index, **RUN.workload
        )
        self.seq = 0
        self.slot: _Slot | None = None

    def wait_time(self) -> float:
        clock = RUN.clock
        if clock is None:
            return 0.0  # closed loop: the next request as soon as the last one ended
        if self.slot is None:
            self.slot = clock.claim()
        if self.slot is None:
            return 1.0  # schedule exhausted: idle until the shape ends the test
        return max(0.0, self.slot.due - time.perf_counter())

    @task
    def generate(self) -> None:
        clock = RUN.clock
        if clock is None:
            step = None
            current = getattr(self.environment.shape_class, "current_step", None)
            if current is not None:
                step = current()
            self._send(next(self.stream), step, None)
            return
        if self.slot is None:  # the first task runs before any wait: claim here, sleep in wait_time
            self.slot = clock.claim()
        if self.slot is None or self.slot.due > time.perf_counter():
            return
        slot, self.slot = self.slot, None
        step = (slot.arrival.step_index, shapes.rate_label(slot.arrival.rate_rps))
        self._send(slot.request, step, slot.scheduled_s)

    def _body(self, request: dict[str, Any]) -> dict[str, Any]:
        options = self.environment.parsed_options
        body: dict[str, Any] = {
            "model": RUN.model,
            "max_tokens": request["max_tokens"],
            "temperature": request["temperature"],
            "top_p": request["top_p"],
            "seed": request["seed"],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if options.api == "chat":
            body["messages"] = request["messages"]
        else:
            body["prompt"] = request["prompt"]
        if options.ignore_eos:
            body["ignore_eos"] = True
        body.update(RUN.extra_body)
        return body

    def _send(self, request: dict[str, Any], step: tuple[int, str] | None, scheduled_s: float | None) -> None:
        options = self.environment.parsed_options
        api, profile = options.api, options.profile
        headers = {"Accept": "text/event-stream", "Accept-Encoding": "identity", **_headers(options)}
        body = self._body(request)
        users = self.environment.runner.user_count if self.environment.runner else None
        first = last = None
        gaps_sum, gaps_max, chunks = 0.0, 0.0, 0
        usage: dict[str, Any] = {}
        error: str | None = None

        start_s = time.time()
        t0 = time.perf_counter()
        with self.client.post(
            PATHS[api],
            json=body,
            headers=headers,
            stream=True,
            catch_response=True,
            timeout=(30, options.request_timeout),
        ) as response:
            status = int(response.status_code or 0)
            try:
                if getattr(response, "error", None) is not None and not status:
                    error = f"{type(response.error).__name__}: {response.error}"
                elif status != 200:
                    error = f"HTTP {status}: {response.text[:500]}"
                else:
                    for line in _sse_lines(response):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            break
                        now = time.perf_counter()
                        event = json.loads(data)
                        if event.get("error"):
                            err = event["error"]
                            error = (
                                f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                            )
                            break
                        if _has_text(event, api):
                            if first is None:
                                first = now
                            else:
                                gap = now - last  # type: ignore[operator]
                                gaps_sum += gap
                                gaps_max = max(gaps_max, gap)
                            last = now
                            chunks += 1
                        if event.get("usage"):
                            usage = event["usage"]
                    if error is None and first is None:
                        error = "empty response: no chunk with generated text"
            except Exception as e:  # a broken stream, a bad event; GreenletExit (a hard stop) passes through
                error = f"{type(e).__name__}: {e}"
            end = time.perf_counter()
            e2e = end - t0
            response.request_meta["response_time"] = e2e * 1000
            if error:
                response.failure(error)
            else:
                response.success()

        tokens = int(usage.get("completion_tokens") or chunks)
        ttft = first - t0 if first is not None else None
        tpot = (e2e - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None
        itl_mean = gaps_sum / (chunks - 1) if chunks > 1 else None
        itl_max = gaps_max if chunks > 1 else None
        ok = error is None
        if ok:
            self._metric("TTFT", profile, ttft)
            self._metric("TPOT", profile, tpot)
            self._metric("ITL", profile, itl_mean)
            self._metric("ITL_MAX", profile, itl_max)
            self.environment.events.request.fire(
                request_type="TOKENS",
                name=profile,
                response_time=tokens,
                response_length=0,
                exception=None,
                context={},
            )
        RUN.write(
            {
                "run": RUN.id,
                "profile": profile,
                "api": api,
                "model": RUN.model,
                "user": self.index,
                "seq": self.seq,
                "request_id": request["id"],
                "kind": request["kind"],
                "conversation": request["conversation"],
                "turn": request["turn"],
                "step": step[1] if step else None,
                "step_index": step[0] if step else None,
                "users": users,
                "start_s": start_s,
                "scheduled_s": scheduled_s,
                "send_lag_s": start_s - scheduled_s if scheduled_s is not None else None,
                "ttft_s": ttft,
                "tpot_s": tpot,
                "e2e_s": e2e,
                "itl_mean_s": itl_mean,
                "itl_max_s": itl_max,
                "chunks": chunks,
                "output_tokens": tokens,
                "prompt_tokens": usage.get("prompt_tokens"),
                "tokens_from": "usage" if usage.get("completion_tokens") is not None else "chunks",
                "status": status,
                "error": error,
            }
        )
        self.seq += 1
        if status == 0:
            time.sleep(CONNECT_ERROR_PAUSE_S)  # no server: do not spin (time.sleep is gevent's under Locust)

    def _metric(self, kind: str, name: str, value_s: float | None) -> None:
        if value_s is None:
            return
        self.environment.events.request.fire(
            request_type=kind,
            name=name,
            response_time=value_s * 1000,
            response_length=0,
            exception=None,
            context={},
        )
