"""Schemathesis against the `secure` app's served /openapi.json: each operation the document lists (the open
routes only) gets a batch of generated requests, valid and invalid (Schemathesis's examples, coverage and
fuzzing phases). No request may get a 5xx, every 4xx must be OpenAI's error JSON, and after each batch a
normal request must still be served.

Schemathesis runs as its CLI (its pytest plugin's lazy schema loading does not work with pytest 9.2); its
HAR report lists every request it sent. Generation stays cheap on the CPU engine because the app's limits
cap it (max_tokens 32, n 2, 256 prompt tokens).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.integration

MIN_REQUESTS = 500
EXAMPLES_PER_OPERATION = 60


def answers_a_normal_request(secure) -> None:
    r = secure.client(timeout=60).chat.completions.create(
        model="tiny-qwen3-secure", messages=[{"role": "user", "content": "still there?"}], max_tokens=2
    )
    assert r.choices[0].finish_reason in ("length", "stop")


def fuzz_batch(secure, schema_file: Path, operation: str, har: Path) -> subprocess.CompletedProcess:
    """One Schemathesis run over one operation ("METHOD /path"), its requests written to `har`."""
    schemathesis = Path(sys.executable).parent / "schemathesis"
    command = [
        str(schemathesis), "run", str(schema_file), "--url", secure.base_url,
        "-H", f"Authorization: Bearer {secure.keys[0]}", "--include-name", operation,
        "--phases", "examples,coverage,fuzzing", "--checks", "not_a_server_error",
        "--max-examples", str(EXAMPLES_PER_OPERATION), "--seed", "16", "--request-timeout", "60",
        "--report", "har", "--report-har-path", str(har), "--no-color",
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=900)


def har_entries(har: Path) -> list[dict]:
    return json.loads(har.read_text())["log"]["entries"]


def test_generated_requests_get_no_5xx_and_their_4xx_in_openai_json(secure, tmp_path):
    schema = httpx.get(f"{secure.base_url}/openapi.json", headers=secure.auth(), timeout=30).json()
    schema_file = tmp_path / "openapi.json"
    schema_file.write_text(json.dumps(schema))
    operations = [f"{m.upper()} {path}" for path, ops in schema["paths"].items() for m in ops]
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"} <= set(operations)
    sent: list[tuple[str, int]] = []
    problems: list[str] = []
    for i, operation in enumerate(operations):
        har = tmp_path / f"batch{i}.har"
        run = fuzz_batch(secure, schema_file, operation, har)
        entries = har_entries(har)
        assert {e["request"]["url"].split("?")[0] for e in entries} == {
            secure.base_url + operation.split()[1]
        }
        for entry in entries:
            status, content = entry["response"]["status"], entry["response"]["content"].get("text", "")
            sent.append((operation, status))
            if status >= 500:
                problems.append(f"{operation}: {status} {content[:300]}")
            elif status >= 400:
                error = json.loads(content).get("error", {})
                if error.get("code") != status or not error.get("message"):
                    problems.append(f"{operation}: {status} not OpenAI's error JSON: {content[:300]}")
        print(f"{operation}: {len(entries)} requests, exit {run.returncode}")
        assert run.returncode == 0 or problems, run.stdout[-3000:]
        answers_a_normal_request(secure)  # after every batch
    statuses = sorted({s for _, s in sent})
    print(f"{len(sent)} generated requests over {len(operations)} operations; statuses {statuses}")
    assert not problems, problems[:10]
    assert len(sent) >= MIN_REQUESTS
    assert 200 in statuses and 400 in statuses  # both valid and refused requests were generated
