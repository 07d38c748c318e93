#!/usr/bin/env bash
# A short headless Locust run against the embedded default (started here unless one already answers on
# :8000): writes Locust's CSVs and the per-request raw file to results/loadtest/, then prints exact
# percentiles from the raw file.
#   LOADTEST_USERS (8), LOADTEST_DURATION (30s), LOADTEST_PROFILE (structured)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${HEADROOM_VENV:-.venv}
out=results/loadtest
url=http://127.0.0.1:8000
mkdir -p "$out"
rm -f "$out"/raw.jsonl
server=""
if ! curl -sf "$url/v1/models" >/dev/null; then
  "$venv/bin/headroom" serve --env local > "$out/server.log" 2>&1 &
  server=$!
  trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
  for _ in $(seq 1 120); do curl -sf "$url/v1/models" >/dev/null && break; sleep 2; done
fi
"$venv/bin/python" -m locust -f loadtests/locustfile.py --headless \
  -u "${LOADTEST_USERS:-8}" -r "${LOADTEST_USERS:-8}" -t "${LOADTEST_DURATION:-30s}" \
  --host "$url" --model tiny-qwen3 --profile "${LOADTEST_PROFILE:-structured}" --max-tokens 64 \
  --csv "$out/run" --raw-file "$out/raw.jsonl" --only-summary
"$venv/bin/python" -m loadtests.raw_stats "$out/raw.jsonl" --by none
