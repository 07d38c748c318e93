"""Ray Serve's replica log file keeps being written after vLLM configures its logging (engine.py,
serve_log_file_kept). Each case runs in a fresh interpreter: vLLM's dictConfig closes every handler in the
process it runs in, pytest's own included."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# Serve's replica logger as Ray 2.60 builds it (ray/serve/_private/logging_utils.py): a MemoryHandler of
# capacity 1 on `ray.serve` in front of a RotatingFileHandler; then vLLM's logging set-up, as an engine's
# creation runs it, and records before and after.
SCRIPT = textwrap.dedent(
    """
    import contextlib, json, logging, logging.handlers, sys
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    from serve_app.serving.engine import serve_log_file_kept

    path, kept = sys.argv[1], sys.argv[2] == "kept"
    serve = logging.getLogger("ray.serve")
    serve.setLevel(logging.INFO)
    serve.propagate = False
    memory = logging.handlers.MemoryHandler(
        1, flushLevel=logging.ERROR, target=logging.handlers.RotatingFileHandler(path, maxBytes=1 << 20)
    )
    serve.addHandler(memory)
    serve.info("before")
    with serve_log_file_kept() if kept else contextlib.nullcontext():
        configure_logging(LoggingConfig())
        serve.info("during")
    for _ in range(3):
        serve.info("POST /v1/completions 200 1.0ms")
    print(json.dumps({"buffered": len(memory.buffer)}))
    """
)


def run_case(tmp_path, case: str) -> tuple[list[str], int]:
    path = tmp_path / f"{case}.log"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), case], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    buffered = json.loads(done.stdout.strip().splitlines()[-1])["buffered"]
    return path.read_text().splitlines(), buffered


@pytest.mark.parametrize("case", ["kept", "plain"])
def test_serve_log_file_is_written_after_vllm_configures_logging_only_when_kept(tmp_path, case):
    lines, buffered = run_case(tmp_path, case)
    access = ["POST /v1/completions 200 1.0ms"] * 3
    if case == "kept":
        assert lines == ["before", "during", *access]
        assert buffered == 0
    else:  # what headroom's replicas did before: the file stops, the handler keeps every record
        assert lines == ["before"]
        assert buffered == 4
