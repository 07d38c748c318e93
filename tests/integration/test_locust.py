"""The Locust users (loadtests/locustfile.py) run as `locust` itself runs them, as a subprocess.

1. Against a fake OpenAI streaming server with known timing (no engine, seconds): TTFT, TPOT and
   inter-token gaps come out as the server paced them, for chat (chunked transfer) and completions
   (a close-delimited body), and the ladder and open-loop shapes label their requests.
2. Against the shared test cluster (the real headroom app, `main` at /, ngram speculation): the raw file's
   successful requests are exactly the requests the server's own TTFT histogram counted, and the
   medians agree within the tolerance stated at `test_locust_matches_server_histograms`.
3. `make loadtest` as a user runs it, with no server running: it starts one, loads it, returns by itself
   and leaves nothing it started behind; also when interrupted with Ctrl-C.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import psutil
import pytest

from loadtests.measure import STEP_WARMUP_S, percentile
from loadtests.raw_stats import bucket_increase, histogram_quantile, is_success, load_records
from loadtests.smoke import locust_command

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MAIN = {"application": "main"}
TTFT = "ray_headroom_ttft_seconds"


def run_locust(
    host: str, tmp: Path, *args: str, model: str = "fake", timeout_s: float = 180
) -> tuple[list[dict], Path]:
    """Runs a headless Locust test (the one command line, loadtests/smoke.py's); returns the raw records
    and the CSV prefix."""
    prefix = tmp / "run"
    cmd = locust_command(host, model, tmp / "raw.jsonl", {"--csv": str(prefix)}) + list(args)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, (
        f"locust exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return load_records(tmp / "raw.jsonl"), prefix


def stats_rows(prefix: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(f"{prefix}_stats.csv", newline="") as f:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}


def median(records: list[dict], key: str) -> float:
    return percentile([r[key] for r in records], 50)


def assert_consistent(record: dict) -> None:
    """TTFT and TPOT present and consistent with e2e for a successful request."""
    ttft, tpot, e2e, n = record["ttft_s"], record["tpot_s"], record["e2e_s"], record["output_tokens"]
    assert ttft is not None and tpot is not None, record
    assert 0 < ttft < e2e, record
    assert tpot * (n - 1) <= e2e - ttft + 1e-6, record
    assert record["tokens_from"] == "usage", record


# --------------------------------------------------------------------------------------------------------
# 1. A fake server with known timing
# --------------------------------------------------------------------------------------------------------

FIRST_TOKEN_S = 0.200
TOKEN_GAP_S = 0.020


class FakeOpenAI(BaseHTTPRequestHandler):
    """Streams max_tokens one-token chunks: the first after FIRST_TOKEN_S, then one every TOKEN_GAP_S.

    Chat is sent with chunked transfer encoding and starts with vLLM's role-only chunk (empty content,
    which must not count as the first token); completions as a body that ends when the connection closes.
    """

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        chat = self.path == "/v1/chat/completions"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if chat:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()

        def send(payload: dict | str) -> None:
            data = (
                b"data: " + (payload if isinstance(payload, str) else json.dumps(payload)).encode() + b"\n\n"
            )
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chat else data)
            self.wfile.flush()

        if chat:
            send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        n = body["max_tokens"]
        for i in range(n):
            time.sleep(FIRST_TOKEN_S if i == 0 else TOKEN_GAP_S)
            choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
            send({"choices": [choice]})
        send({"choices": [], "usage": {"prompt_tokens": 17, "completion_tokens": n, "total_tokens": n + 17}})
        send("[DONE]")
        if chat:
            self.wfile.write(b"0\r\n\r\n")


@pytest.fixture(scope="module")
def fake_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_locust_measures_what_the_server_paced(fake_server, tmp_path, api):
    n = 8
    records, prefix = run_locust(
        fake_server, tmp_path, "-u", "2", "-r", "2", "-t", "3s", "--api", api,
        "--profile", "structured", "--max-tokens", str(n),
    )  # fmt: skip
    assert len(records) >= 6
    for r in records:
        assert is_success(r), r
        assert_consistent(r)
        assert r["output_tokens"] == n and r["chunks"] == n and r["prompt_tokens"] == 17
        # physical bounds: the server waited this long before the first token, and paced the rest
        assert r["ttft_s"] >= FIRST_TOKEN_S, r
        assert r["e2e_s"] >= FIRST_TOKEN_S + (n - 1) * TOKEN_GAP_S, r
        assert r["itl_mean_s"] <= r["itl_max_s"], r
    # Medians, with upper margins for a busy 2-core box (it delays the fake server and the client alike;
    # a late first chunk can even shorten one request's TPOT, hence medians). A role-only chunk taken
    # for the first token would put TTFT near 0; a client that buffered the stream, TPOT near 0.
    assert FIRST_TOKEN_S <= median(records, "ttft_s") < FIRST_TOKEN_S + 0.06
    assert TOKEN_GAP_S * 0.95 <= median(records, "tpot_s") < TOKEN_GAP_S + 0.01
    assert TOKEN_GAP_S * 0.95 <= median(records, "itl_mean_s") < TOKEN_GAP_S + 0.01
    # one request stream per user, in order
    users = {r["user"] for r in records}
    assert users == {0, 1}
    for u in users:
        assert [r["seq"] for r in records if r["user"] == u] == list(
            range(sum(r["user"] == u for r in records))
        )
    rows = stats_rows(prefix)
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    assert int(rows[("POST", path)]["Request Count"]) == len(records)
    for kind in ("TTFT", "TPOT", "ITL", "ITL_MAX", "TOKENS"):
        assert int(rows[(kind, "structured")]["Request Count"]) == len(records)
    assert 200 <= float(rows[("TTFT", "structured")]["Median Response Time"]) < 300


def test_ladder_labels_each_request_with_its_step(fake_server, tmp_path):
    records, _ = run_locust(
        fake_server, tmp_path, "--ladder", "1:3,3:3", "--profile", "random",
        "--max-tokens", "4",
    )  # fmt: skip
    steps = {r["step"] for r in records}
    assert steps == {"c=1", "c=3"}
    assert {r["user"] for r in records if r["step"] == "c=1"} == {0}
    assert {r["users"] for r in records if r["step"] == "c=1"} == {1}
    assert max(r["users"] for r in records if r["step"] == "c=3") == 3  # new users start within a second
    assert all(r["step_index"] == (0 if r["step"] == "c=1" else 1) for r in records)


def test_ladder_stops_at_the_first_step_over_the_slo(fake_server, tmp_path):
    # The fake server's TTFT is 200 ms: a 100 ms bound breaks at the first step, a 1000 ms one never.
    started = time.monotonic()
    records, _ = run_locust(
        fake_server, tmp_path, "--ladder", "1:4,2:4,3:4", "--stop-ttft-p95-ms", "100",
        "--profile", "random", "--max-tokens", "2",
    )  # fmt: skip
    assert time.monotonic() - started < 12  # the whole ladder takes 12 s
    assert {r["step"] for r in records} <= {"c=1", "c=2"} and any(r["step"] == "c=1" for r in records)
    second = [r["start_s"] for r in records if r["step"] == "c=2"]
    assert not second or max(second) - min(second) < STEP_WARMUP_S  # only the next step's warm-up
    (tmp_path / "raw.jsonl").unlink()
    records, _ = run_locust(
        fake_server, tmp_path, "--ladder", "1:3,2:3", "--stop-ttft-p95-ms", "1000",
        "--profile", "random", "--max-tokens", "2",
    )  # fmt: skip
    assert {r["step"] for r in records} == {"c=1", "c=2"}


def test_open_loop_sends_on_the_seeded_schedule(fake_server, tmp_path):
    records, _ = run_locust(
        fake_server, tmp_path, "--arrival-rate", "8:4", "--max-in-flight", "8", "--seed", "5",
        "--profile", "shared-prefix", "--prefix-tokens", "300", "--max-tokens", "4",
    )  # fmt: skip
    from loadtests.workloads import arrival_times, make_requests, parse_steps

    expected = arrival_times(parse_steps("8:4"), seed=5)
    assert len(records) == len(expected)
    assert {r["step"] for r in records} == {"rate=8"}
    # arrival k carries request k of the shared stream, whichever user sent it
    ids = [r["request_id"] for r in sorted(records, key=lambda r: r["scheduled_s"])]
    assert ids == [q["id"] for q in make_requests("shared-prefix", len(expected), 5)]
    # sent on time: each request is 4 tokens (~0.26 s), so a pool of 8 covers 8 requests/s
    t0 = min(r["scheduled_s"] for r in records)
    offsets = sorted(r["scheduled_s"] - t0 for r in records)
    assert offsets == pytest.approx([a.at_s - expected[0].at_s for a in expected], abs=1e-3)
    assert percentile([r["send_lag_s"] for r in records], 90) < 0.1


def test_a_run_that_cannot_start_sends_nothing_and_fails(fake_server, tmp_path):
    """--tokens-per-word auto asks the server's /tokenize, which the fake server does not serve (nor does
    headroom's without security.optional_routes: [tokenize]). Locust only logs a failing test_start
    listener; the users must not fall back to a closed loop of the default workload (a GPU replay once
    sent 216,112 such requests for a 4,600-request trace): no request, exit code 1, at once."""
    raw = tmp_path / "raw.jsonl"
    flags = {"--arrival-rate": "8:30", "--tokens-per-word": "auto", "-t": "60s"}
    started = time.monotonic()
    proc = subprocess.run(
        locust_command(fake_server, "fake", raw, flags), cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "the run could not start" in proc.stderr, proc.stderr[-3000:]
    assert not raw.exists() or load_records(raw) == []
    assert time.monotonic() - started < 30, "the run went on after failing to start"


# --------------------------------------------------------------------------------------------------------
# 2. The real server: the same requests as its Prometheus histograms
# --------------------------------------------------------------------------------------------------------


def histogram(cluster, name: str, **labels: str) -> dict[float, float]:
    """Cumulative bucket counts {le: count}, summed over every series with these labels."""
    buckets: dict[float, float] = {}
    for lab, value in cluster.metrics().get(f"{name}_bucket", []):
        if all(lab.get(k) == v for k, v in labels.items()):
            le = float(lab["le"])  # "+Inf" parses as inf
            buckets[le] = buckets.get(le, 0.0) + value
    return buckets


def settled(cluster, name: str, quiet_s: float = 15.0, timeout_s: float = 120.0, **labels: str) -> float:
    """The metric's value once it has stopped changing for quiet_s. Ray's metrics agent exports on an
    interval (metrics_report_interval_ms, 10 s by default), so an earlier test's requests, or the tail of
    our own run, can still be on their way."""
    deadline = time.time() + timeout_s
    value, since = cluster.metric_sum(name, **labels), time.time()
    while time.time() < deadline:
        time.sleep(1)
        now = cluster.metric_sum(name, **labels)
        if now != value:
            value, since = now, time.time()
        elif time.time() - since >= quiet_s:
            return value
    raise AssertionError(f"{name}{labels} kept changing for {timeout_s}s (last {value})")


def test_locust_matches_server_histograms(cluster, tmp_path):
    """`make loadtest`'s run, checked against the server's own TTFT histogram.

    Counts: every successful request in the raw file is one observation of ray_headroom_ttft_seconds on
    the `main` app, and nothing else reached it, so the histogram's count rises by exactly that number
    (Locust stops gracefully: in-flight requests finish, none is cut off half-counted).

    Medians, and the tolerance. The server times TTFT from the request's arrival at the replica's HTTP
    app to the engine's first token; the client from just before sending to the first text chunk
    parsed, which adds the ingress (HAProxy), the Serve proxy, the network hop, SSE framing and the
    client's own scheduling. So per request client >= server, and the client's median is >= the
    server's. The server's median is known only to its bucket [lower, upper] (PromQL's interpolation
    within it can be off by up to the bucket's width; the buckets are 5, 10, 20, 50, 100, 200, 300,
    500 ms, ...). Asserted:
        lower - 5 ms  <=  client median  <=  upper + max(20 ms, 50% of upper)
        |client median - interpolated server median|  <=  (upper - lower) + max(20 ms, 50% of it)
    The 5 ms allows for the two clocks (the server mixes wall-clock and monotonic stamps); max(20 ms,
    50%) bounds the client-side overhead: about 1 ms through the proxy at low load on this machine
    (results/bench_overhead), but the locust process shares 2 cores with two engines, and its parsing
    and greenlet scheduling under load reach tens of ms.
    """
    before_count = settled(cluster, f"{TTFT}_count", **MAIN)
    before_buckets = histogram(cluster, TTFT, **MAIN)

    records, prefix = run_locust(
        cluster.base_url, tmp_path, "-u", "4", "-r", "4", "-t", "15s", "--profile", "structured",
        "--max-tokens", "32", model="tiny-qwen3",
    )  # fmt: skip

    # The CSV and the raw file exist and agree.
    assert Path(f"{prefix}_stats.csv").exists() and Path(f"{prefix}_stats_history.csv").exists()
    rows = stats_rows(prefix)
    ok = [r for r in records if is_success(r)]
    assert len(ok) >= 10, f"only {len(ok)} successful requests in 15 s"
    assert len(ok) == len(records), [r["error"] for r in records if not is_success(r)][:5]
    assert int(rows[("POST", "/v1/chat/completions")]["Request Count"]) == len(records)
    assert int(rows[("TTFT", "structured")]["Request Count"]) == len(ok)
    assert int(rows[("TPOT", "structured")]["Request Count"]) == len(ok)
    assert len({r["run"] for r in records}) == 1

    # TTFT and TPOT present for every successful request, and consistent with e2e.
    for r in ok:
        assert_consistent(r)
        assert r["output_tokens"] == 32, r

    # The server counted exactly these requests.
    cluster.wait_for_metric(f"{TTFT}_count", before_count + len(ok), timeout_s=120, **MAIN)
    after_count = settled(cluster, f"{TTFT}_count", **MAIN)
    assert after_count - before_count == len(ok)

    # Medians within the stated tolerance.
    increase = bucket_increase(before_buckets, histogram(cluster, TTFT, **MAIN))
    server = histogram_quantile(increase, 0.5)
    assert server.count == len(ok)
    client = percentile([r["ttft_s"] for r in ok], 50)
    overhead = max(0.020, 0.5 * server.upper)
    detail = f"client median {client * 1000:.1f} ms, server {server} (bucket increase {increase})"
    print(detail)  # shown with -s
    assert not math.isinf(server.upper), detail
    assert server.lower - 0.005 <= client <= server.upper + overhead, detail
    assert abs(client - server.value) <= (server.upper - server.lower) + max(0.020, 0.5 * server.value), (
        detail
    )


# --------------------------------------------------------------------------------------------------------
# 3. make loadtest, as a user runs it
# --------------------------------------------------------------------------------------------------------

LOADTEST_URL = "http://127.0.0.1:8000/v1/models"


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def marked(marker: str) -> list[psutil.Process]:
    """Processes whose environment carries `marker`: everything `make loadtest` started, Ray's daemons,
    the replica and its engine included (they inherit it), whatever process group or session they are in."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("HEADROOM_TEST_MARKER") == marker:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def as_from_a_terminal() -> None:
    """Ctrl-C and Ctrl-\\ as a terminal gives them: a test runner started in the background (`cmd &`,
    nohup) passes SIGINT and SIGQUIT on ignored, and a shell that starts with a signal ignored can neither
    trap nor reset it, so make loadtest's traps and its server's Ctrl-C handling would never run."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def start_make_loadtest(out: Path, marker: str) -> subprocess.Popen:
    assert not answers(LOADTEST_URL), "a server already answers on :8000; make loadtest would use it"
    venv = Path(sys.executable).parents[1]
    env = {**os.environ, "HEADROOM_TEST_MARKER": marker, "LOADTEST_OUT": str(out)}
    env.update(LOADTEST_DURATION="6s", LOADTEST_USERS="2")
    env.pop("RAY_ADDRESS", None)
    # -o: the virtualenv counts as set up (it is: this test runs in it).
    cmd = ["make", "-o", str(venv / ".headroom-setup"), "loadtest", f"VENV={venv}"]
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        start_new_session=True,
        preexec_fn=as_from_a_terminal,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout_s: float) -> str:
    try:
        return proc.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def assert_nothing_left(marker: str) -> None:
    deadline = time.monotonic() + 20  # processes being reaped
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = marked(marker)
    names = [(p.pid, p.name()) for p in left]
    for p in left:  # the test's own processes: not left on the machine even when it fails
        p.kill()
    assert not names, f"left behind: {names}"
    assert not answers(LOADTEST_URL)


def test_make_loadtest_returns_and_stops_its_server(tmp_path):
    marker = uuid.uuid4().hex
    proc = start_make_loadtest(tmp_path, marker)
    try:
        output = finish(proc, timeout_s=480)
        assert proc.returncode == 0, output[-4000:]
        assert "starting headroom serve" in output and "stopping the server" in output, output[-4000:]
        records = load_records(tmp_path / "raw.jsonl")
        assert records and all(is_success(r) for r in records), records[:3]
        assert (tmp_path / "server.log").is_file()
    finally:
        assert_nothing_left(marker)


def test_make_loadtest_stops_its_server_on_ctrl_c(tmp_path):
    marker = uuid.uuid4().hex
    proc = start_make_loadtest(tmp_path, marker)
    try:
        deadline = time.monotonic() + 360
        while not answers(LOADTEST_URL):
            assert proc.poll() is None and time.monotonic() < deadline, "the server never came up"
            time.sleep(1)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the foreground group gets it
        output = finish(proc, timeout_s=180)
        assert proc.returncode != 0, output[-4000:]
        assert "stopping the server" in output, output[-4000:]
    finally:
        assert_nothing_left(marker)
