"""Safe to put on a network: API keys, closed routes, request limits, client disconnects.

Against the session's `secure` app (two replicas, keys from a file, tests/integration/configs/secure.yaml),
the `draft` app (its own key, from an environment variable) and `main` (no keys, no token limit), through
HAProxy, with the official openai client where a client would use it.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import time
import urllib.parse
from pathlib import Path

import httpx
import openai
import pytest
import ray
import yaml
from ray import serve

import serve_app.rollout as ro
from autoscale.replica_stats import NUM_REQUESTS_RUNNING
from loadtests.processes import serve_replicas
from serve_app.models.resolve import resolve_models
from serve_app.serving.engine import build_app, parse_serve_args
from serve_app.serving.engine_args import PlannedEngine, vllm_cli_args
from serve_app.serving.request_guard import open_routes
from tests.integration.conftest import DRAFT_KEYS_ENV, HERE

pytestmark = pytest.mark.integration

MODEL = "tiny-qwen3-secure"
HI = [{"role": "user", "content": "hi"}]


def error_of(response: httpx.Response, status: int) -> dict:
    """The OpenAI error object of a response that must have `status`."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    return error


# --- API keys -------------------------------------------------------------------------------------------


def test_requests_without_the_apps_key_get_401(cluster, secure):
    draft_key = cluster.keys["/draft"]
    chat = {"model": MODEL, "messages": HI, "max_tokens": 2}
    for key in (None, "wrong-key", draft_key, secure.keys[0][:-1]):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", chat)):
            r = httpx.request(method, f"{secure.base_url}{path}", json=body, headers=headers, timeout=30)
            assert r.headers["www-authenticate"] == "Bearer"
            error_of(r, 401)
    # ... and the secure app's key is no key for the draft app.
    r = httpx.get(f"{cluster.base_url}/draft/v1/models", headers=secure.auth(), timeout=30)
    error_of(r, 401)
    with pytest.raises(openai.AuthenticationError):
        secure.client(key=draft_key).models.list()


def test_either_key_works_with_the_official_client(secure):
    for key in secure.keys:
        client = secure.client(key=key)
        assert [m.id for m in client.models.list().data] == [MODEL]
        r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4)
        assert r.usage.completion_tokens <= 4 and r.choices[0].message.content is not None


def test_health_stays_open_and_metrics_need_a_key_when_configured(cluster, secure):
    assert httpx.get(f"{secure.base_url}/health", timeout=30).status_code == 200
    error_of(httpx.get(f"{secure.base_url}/metrics", timeout=30), 401)
    assert httpx.get(f"{secure.base_url}/metrics", headers=secure.auth(), timeout=30).status_code == 200
    # main has no keys and its metrics are open.
    assert httpx.get(f"{cluster.base_url}/metrics", timeout=30).status_code == 200


def test_no_key_appears_in_rendered_config_status_logs_or_metrics(cluster, secure, tmp_path):
    secrets_ = [*secure.keys, cluster.keys["/draft"]]
    # Use every key, rightly and wrongly, so that a leak into a log line would have happened by now.
    for key in secrets_:
        httpx.get(f"{secure.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        httpx.get(
            f"{cluster.base_url}/draft/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30
        )
    overlay = tmp_path / "secure-keys.yaml"
    overlay.write_text(yaml.safe_dump({"security": {"api_keys": {"file": str(secure.key_file)}}}))
    configs = Path(__file__).parents[2] / "configs"
    secure_files = [configs / "base.yaml", configs / "local.yaml", HERE / "configs" / "secure.yaml", overlay]
    draft_files = [configs / "base.yaml", configs / "local.yaml", HERE / "configs" / "draft.yaml"]
    rendered = yaml.safe_dump(ro.render(config_files=secure_files)) + yaml.safe_dump(
        ro.render(config_files=draft_files)
    )
    assert str(secure.key_file) in rendered and DRAFT_KEYS_ENV in rendered  # where the keys are, not them
    status = ro.status(address=f"http://{ray._private.worker.get_dashboard_url()}")
    assert any(app["name"] == "secure" for app in status["applications"])
    surfaces = {
        "rendered Serve configs": rendered,
        "headroom status": json.dumps(status) + ro.format_status(status),
        "Prometheus export": httpx.get(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=30).text,
        "replica /metrics": httpx.get(f"{secure.base_url}/metrics", headers=secure.auth(), timeout=30).text,
    }
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    log_files = [p for p in logs.rglob("*") if p.is_file()]
    assert len(log_files) > 10  # Ray's, Serve's and every replica's logs
    leaks = [(p.name, k[:8]) for p in log_files for k in secrets_ if k.encode() in p.read_bytes()]
    assert not leaks, f"keys found in log files: {leaks}"
    for where, text in surfaces.items():
        for key in secrets_:
            assert key not in text, f"a key appears in the {where}"


# --- routes ---------------------------------------------------------------------------------------------


def vllm_routes(secure) -> list[tuple[str, set[str]]]:
    """Every route of vLLM's app as a replica builds it (same flags), with its methods."""
    cfg = secure.cfg
    args = parse_serve_args(
        vllm_cli_args(cfg, resolve_models(cfg), PlannedEngine(1, cfg.engine.max_num_seqs))
    )
    app = build_app(args, ("generate",), None)
    routes = []
    for route in app.routes:
        path = route.path.replace("{response_id}", "resp-1").replace("{path:path}", "x")
        methods = set(getattr(route, "methods", None) or {"GET", "POST"})
        routes.append((path, methods))
    return routes


def test_every_route_headroom_does_not_open_answers_404(secure):
    opened = open_routes(secure.cfg.security)
    probes = [(p, m) for p, methods in vllm_routes(secure) for m in sorted(methods) if p not in opened]
    probes += [("/metricsfoo", "GET"), ("/metrics/", "GET"), ("/v1/models/", "GET"), ("/V1/models", "GET")]
    assert len(probes) > 20  # vLLM's admin, render, SageMaker, responses, ... routes
    with httpx.Client(timeout=30, headers=secure.auth()) as client:
        for path, method in probes:
            r = client.request(method, f"{secure.base_url}{path}", json={} if method == "POST" else None)
            assert error_of(r, 404)["message"].startswith(f"No route for {method}"), (path, r.text)


def test_the_opened_routes_answer_and_the_openapi_document_lists_only_them(secure):
    with httpx.Client(timeout=30, headers=secure.auth()) as client:
        tokens = client.post(f"{secure.base_url}/tokenize", json={"model": MODEL, "prompt": "a b c"}).json()
        assert tokens["count"] > 0
        text = client.post(f"{secure.base_url}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]})
        assert "a b c" in text.json()["prompt"]
        assert client.get(f"{secure.base_url}/docs").status_code == 200
        paths = client.get(f"{secure.base_url}/openapi.json").json()["paths"]
        assert set(paths) <= set(open_routes(secure.cfg.security))
        assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize"} <= set(paths)
        error_of(client.put(f"{secure.base_url}/v1/models"), 405)


# --- limits ---------------------------------------------------------------------------------------------


def peak_rss_reset(pids: list[int]) -> None:
    for pid in pids:  # resets VmHWM (the peak resident set) to the current resident set
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak_rss_bytes(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM"))
    return int(line.split()[1]) * 1024


def post_as_curl_does(url: str, headers: dict, body: bytes, chunked: bool, timeout_s: float = 30):
    """POSTs `body` and, like curl, stops sending once the server answers: an early 413 is read while the
    upload is still going (httpx writes the whole body first, and a proxy that stops reading after the
    answer leaves it blocked). Returns (status, JSON body), or None when the connection was reset before
    an answer could be read (the server closed it mid-upload)."""
    u = urllib.parse.urlsplit(url)
    framing = {"transfer-encoding": "chunked"} if chunked else {"content-length": str(len(body))}
    head = f"POST {u.path} HTTP/1.1\r\nhost: {u.netloc}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in {**headers, **framing}.items()
    )
    pieces = [body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20)]
    if chunked:
        pieces = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]
    pending = (head + "\r\n").encode() + b"".join(pieces)
    with socket.create_connection((u.hostname, u.port), timeout=timeout_s) as sock:
        sock.setblocking(False)
        deadline = time.monotonic() + timeout_s
        try:
            while pending:
                readable, writable, _ = select.select(
                    [sock], [sock], [], max(0.0, deadline - time.monotonic())
                )
                if readable:
                    break  # the answer is here: stop sending
                if not writable:
                    raise TimeoutError(f"nothing sent or answered for {timeout_s} s")
                pending = pending[sock.send(pending[: 1 << 16]) :]
        except (BrokenPipeError, ConnectionResetError):
            pass  # the answer may still be readable
        sock.settimeout(max(1.0, deadline - time.monotonic()))
        response = http.client.HTTPResponse(sock)
        try:
            response.begin()
            return response.status, response.getheader("content-type"), json.loads(response.read())
        except (ConnectionResetError, http.client.RemoteDisconnected):
            return None


def test_a_20_mb_body_gets_413_without_the_replica_holding_it(secure):
    pids = [p.pid for p in serve_replicas("secure")]
    assert len(pids) == 2
    peak_rss_reset(pids)
    before = {pid: peak_rss_bytes(pid) for pid in pids}
    body = b"x" * (20 * 1024 * 1024)
    url = f"{secure.base_url}/v1/chat/completions"
    headers = {**secure.auth(), "content-type": "application/json"}
    answered = 0
    for _ in range(3):  # HAProxy spreads them over both replicas
        for chunked in (False, True):
            answer = post_as_curl_does(url, headers, body, chunked)
            if answer is None:
                continue
            status, content_type, error = answer
            assert status == 413 and content_type.startswith("application/json"), answer
            assert "max_body_bytes" in error["error"]["message"], answer
            answered += 1
    assert answered, "every upload was reset before its 413 could be read"
    growth = {pid: peak_rss_bytes(pid) - before[pid] for pid in pids}
    assert max(growth.values()) < 8 * 1024 * 1024, growth


def test_a_body_that_is_not_utf8_gets_openai_json(secure):
    r = httpx.post(
        f"{secure.base_url}/v1/chat/completions",
        content=b'{"model": "tiny-qwen3-secure", "messages": [{"role": "user", "content": "\xff"}]}',
        headers={**secure.auth(), "content-type": "application/json"},
        timeout=30,
    )
    assert "UTF-8" in error_of(r, 400)["message"]


LONG = "token " * 400  # over max_prompt_tokens (256), under max_model_len (2048)

# (case, path, body, the field the 400 names)
OVER_LIMITS = [
    ("n", "/v1/chat/completions", {"messages": HI, "n": 3}, "n"),
    ("max_tokens", "/v1/chat/completions", {"messages": HI, "max_tokens": 33}, "max_tokens"),
    (
        "max_completion_tokens",
        "/v1/chat/completions",
        {"messages": HI, "max_completion_tokens": 500},
        "max_completion_tokens",
    ),
    ("completion max_tokens", "/v1/completions", {"prompt": "a", "max_tokens": 1000}, "max_tokens"),
    ("logprobs", "/v1/completions", {"prompt": "a", "logprobs": 6}, "logprobs"),
    (
        "top_logprobs",
        "/v1/chat/completions",
        {"messages": HI, "logprobs": True, "top_logprobs": 6},
        "top_logprobs",
    ),
    (
        "chat prompt tokens",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": LONG}]},
        "messages",
    ),
    ("prompt tokens", "/v1/completions", {"prompt": LONG, "max_tokens": 4}, "prompt"),
    ("streamed prompt tokens", "/v1/completions", {"prompt": LONG, "stream": True}, "prompt"),
]


@pytest.mark.parametrize("case,path,body,param", OVER_LIMITS, ids=[c[0] for c in OVER_LIMITS])
def test_a_request_over_a_limit_gets_400_naming_the_field(secure, case, path, body, param):
    r = httpx.post(
        f"{secure.base_url}{path}", json={"model": MODEL, **body}, headers=secure.auth(), timeout=60
    )
    error = error_of(r, 400)
    assert error["param"] == param and param in error["message"], error


def test_limits_hold_through_the_official_client(secure):
    client = secure.client()
    with pytest.raises(openai.BadRequestError, match="max_n"):
        client.chat.completions.create(model=MODEL, messages=HI, n=3, max_tokens=2)
    # A request that names no length generates at most max_tokens (32), not up to max_model_len.
    r = client.chat.completions.create(model=MODEL, messages=HI, extra_body={"ignore_eos": True})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (32, "length")
    r = client.chat.completions.create(
        model=MODEL, messages=HI, n=2, max_tokens=3, logprobs=True, top_logprobs=5
    )
    assert len(r.choices) == 2 and len(r.choices[0].logprobs.content[0].top_logprobs) == 5


# --- client disconnect ----------------------------------------------------------------------------------


def running_in_engine(app: str) -> float:
    """The engine's running requests as vLLM's scheduler reports them (SchedulerStats.num_running_reqs, the
    value of vLLM's num_requests_running gauge), read from the app's one replica."""
    stats = serve.get_app_handle(app).record_autoscaling_stats.remote().result(timeout_s=10)
    return stats[NUM_REQUESTS_RUNNING]


def wait_until(condition, timeout_s: float, poll_s: float = 0.05) -> float:
    """Seconds until condition() held; fails after timeout_s."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s} s"
        time.sleep(poll_s)
    return time.monotonic() - start


def test_a_client_that_leaves_mid_stream_frees_its_sequence_in_the_engine(cluster):
    body = {
        "model": "tiny-qwen3",
        "prompt": "leave early",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    wait_until(lambda: running_in_engine("main") == 0, timeout_s=60, poll_s=0.5)
    chunks = 0
    with httpx.stream("POST", f"{cluster.base_url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 5:
                assert running_in_engine("main") == 1  # 1495 tokens to go: it would run for a minute
                break  # leaving the block closes the connection
    freed_after_s = wait_until(lambda: running_in_engine("main") == 0, timeout_s=2.0)
    print(f"num_requests_running back to 0 {freed_after_s:.2f} s after the client left")
