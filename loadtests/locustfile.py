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
  --tokens-per-word X prompt sizing, default 1.3; `auto` asks vLLM's /tokenize (tiny-qwen3: ~4.4), which
                      headroom serves with security.optional_routes: [tokenize] (else the run stops)
  --input-tokens N    random's prompt length; --prefix-tokens N: shared-prefix's system prompt length
  --request-timeout S read timeout (default 600); --api-key K [OPENAI_API_KEY]; --extra-body JSON
  --ladder, --stop-ttft-p95-ms, --arrival-rate, --burstiness, --max-in-flight: the load shape
                      (loadtests/shapes.py): `--ladder 1:30,4:30,16:30` (closed-loop concurrency steps,
                      optionally ended at the first step whose TTFT p95 exceeds --stop-ttft-p95-ms) or
                      `--arrival-rate 2:60 [--burstiness 0.5] [--max-in-flight 64]` (open loop);
                      neither: Locust's -u/-r/-t.

Definitions: loadtests/measure.py (TTFT, e2e, output tokens, TPOT and inter-token gaps, as `vllm bench
serve` defines them), which the streaming client behind the benchmarks shares.

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

import gevent
import requests
from locust import HttpUser, events, task
from locust.exception import StopUser
from locust.runners import MasterRunner, WorkerRunner
from locust.stats import CSV_STATS_INTERVAL_SEC

try:
    from loadtests import measure, shapes, workloads
    from loadtests.shapes import HeadroomShape  # noqa: F401  (Locust runs the shape class it finds here)
except ImportError:  # copied next to its sibling modules, outside the package
    import measure  # type: ignore[no-redef]
    import shapes  # type: ignore[no-redef]
    import workloads  # type: ignore[no-redef]
    from shapes import HeadroomShape  # type: ignore[no-redef]  # noqa: F401

log = logging.getLogger("headroom.locust")

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
        "--api",
        default="chat",
        choices=tuple(measure.API_PATHS),
        env_var="HEADROOM_API",
        help="chat or completions",
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
        help="shared-prefix: system prompt length, tokens",
    )
    group.add_argument(
        "--prefix-count",
        type=int,
        default=1,
        help="shared-prefix: distinct system prompts (tenants), each request picks one",
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
    if options.prefix_count < 1:
        raise SystemExit(f"--prefix-count {options.prefix_count}: expected a whole number >= 1")
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
    try:
        _start_run(environment)
    except Exception as e:  # noqa: BLE001 (any failure: no run state)
        # Without its run state each user would run a closed loop of the default workload, another test
        # than the one asked for (Locust only logs a listener's exception): no user starts, the run ends.
        log.error("the run could not start, stopping with no request sent: %s: %s", type(e).__name__, e)
        environment.process_exit_code = 1
        gevent.spawn(environment.runner.quit)


def _start_run(environment: Any) -> None:
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
        "prefix_count": options.prefix_count,
    }
    RUN.users = itertools.count()
    environment.step_latencies = measure.StepLatencies()
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
        if not RUN.active:  # the run did not start (_on_test_start): send nothing
            raise StopUser()

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
        users = self.environment.runner.user_count if self.environment.runner else None
        start_s = time.time()
        meter = measure.StreamMeter(options.api, time.perf_counter())
        with self.client.post(
            measure.API_PATHS[options.api],
            json=self._body(request),
            headers={"Accept": "text/event-stream", "Accept-Encoding": "identity", **_headers(options)},
            stream=True,
            catch_response=True,
            timeout=(30, options.request_timeout),
        ) as response:
            status = int(response.status_code or 0)
            result = meter.finish(*_read_stream(response, status, meter))
            response.request_meta["response_time"] = result.e2e_s * 1000
            if result.ok:
                response.success()
            else:
                response.failure(result.error)
        if result.ok:
            self._fire_metrics(options.profile, result)
        if step is not None and scheduled_s is None:  # a ladder step: the shape may stop at an SLO breach
            self.environment.step_latencies.add(step[0], start_s, result.ttft_s if result.ok else None)
        RUN.write(self._record(request, step, users, start_s, scheduled_s, status, result))
        self.seq += 1
        if status == 0:
            time.sleep(CONNECT_ERROR_PAUSE_S)  # no server: do not spin (time.sleep is gevent's under Locust)

    def _record(
        self,
        request: dict[str, Any],
        step: tuple[int, str] | None,
        users: int | None,
        start_s: float,
        scheduled_s: float | None,
        status: int,
        result: measure.RequestResult,
    ) -> dict[str, Any]:
        """One line of the raw file (the fields are listed in this module's docstring)."""
        options = self.environment.parsed_options
        return {
            "run": RUN.id,
            "profile": options.profile,
            "api": options.api,
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
            **{k: v for k, v in result.as_dict().items() if k != "error"},
            "status": status,
            "error": result.error,
        }

    def _fire_metrics(self, profile: str, result: measure.RequestResult) -> None:
        """Locust's custom rows for a successful request: latencies in ms, TOKENS as a count."""
        values = {
            "TTFT": result.ttft_s,
            "TPOT": result.tpot_s,
            "ITL": result.itl_mean_s,
            "ITL_MAX": result.itl_max_s,
        }
        rows = {kind: v * 1000 for kind, v in values.items() if v is not None}
        rows["TOKENS"] = result.output_tokens
        for kind, value in rows.items():
            self.environment.events.request.fire(
                request_type=kind,
                name=profile,
                response_time=value,
                response_length=0,
                exception=None,
                context={},
            )


def _read_stream(response: Any, status: int, meter: measure.StreamMeter) -> tuple[float, str | None]:
    """Feeds the response body to `meter` as it arrives; returns the end time and a transport error, if
    any. A broken stream or a bad event is an error; GreenletExit (a hard stop) passes through."""
    error: str | None = None
    try:
        if getattr(response, "error", None) is not None and not status:
            error = f"{type(response.error).__name__}: {response.error}"
        elif status != 200:
            error = f"HTTP {status}: {response.text[:500]}"
        else:
            for line in _sse_lines(response):
                if not meter.feed(line, time.perf_counter()):
                    break
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    return time.perf_counter(), error
