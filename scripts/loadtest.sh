#!/usr/bin/env bash
# A short headless Locust run against the embedded default: writes Locust's CSVs and the per-request raw
# file to $LOADTEST_OUT, then prints exact percentiles from the raw file. Uses the server that answers on
# :8000, else starts one (`headroom serve --env local`, with a Ray cluster of its own) and stops it, and
# everything it started, before returning: also when the load fails, on Ctrl-C and on SIGTERM.
#   LOADTEST_USERS (8), LOADTEST_DURATION (30s), LOADTEST_PROFILE (structured), LOADTEST_OUT (results/loadtest)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${HEADROOM_VENV:-.venv}
out=${LOADTEST_OUT:-results/loadtest}
url=http://127.0.0.1:8000
startup_s=${LOADTEST_STARTUP_S:-300}
mkdir -p "$out"
rm -f "$out"/raw.jsonl

server=""
ray_tmp=""
stop_server() {
  # The server and its Ray cluster are one process group (set -m below). Ctrl-C first, as a user would
  # (headroom serve shuts its app and engine down, then Ray), then SIGTERM, then SIGKILL, each with a
  # deadline: a background process of a non-interactive shell that ignores one signal gets the next.
  if [ -n "$server" ]; then
    echo "stopping the server this script started (process group $server)" >&2
    for sig_deadline in INT:60 TERM:20 KILL:10; do
      kill -s "${sig_deadline%:*}" -- "-$server" 2>/dev/null || break
      for _ in $(seq 1 "${sig_deadline#*:}"); do
        kill -0 -- "-$server" 2>/dev/null || break 2
        sleep 1
      done
    done
    wait "$server" 2>/dev/null || true
  fi
  if [ -n "$ray_tmp" ]; then rm -rf "$ray_tmp"; fi
}
trap stop_server EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if ! curl -sf "$url/v1/models" >/dev/null; then
  echo "no server on $url: starting headroom serve --env local (log: $out/server.log)" >&2
  # A Ray temp dir of its own: a fresh cluster, whatever /tmp/ray holds (another cluster, a stale address).
  ray_tmp=$(mktemp -d /tmp/hr-loadtest.XXXXXX)
  set -m  # job control: the server gets its own process group, and SIGINT is not ignored in it
  RAY_TMPDIR=$ray_tmp "$venv/bin/headroom" serve --env local > "$out/server.log" 2>&1 &
  server=$!
  set +m
  deadline=$((SECONDS + startup_s))
  until curl -sf "$url/v1/models" >/dev/null; do
    if ! kill -0 "$server" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
      echo "the server did not come up within ${startup_s} s; the end of $out/server.log:" >&2
      tail -n 20 "$out/server.log" >&2
      exit 1
    fi
    sleep 2
  done
fi
"$venv/bin/python" -m locust -f loadtests/locustfile.py --headless \
  -u "${LOADTEST_USERS:-8}" -r "${LOADTEST_USERS:-8}" -t "${LOADTEST_DURATION:-30s}" \
  --host "$url" --model tiny-qwen3 --profile "${LOADTEST_PROFILE:-structured}" --max-tokens 64 \
  --csv "$out/run" --raw-file "$out/raw.jsonl" --only-summary
"$venv/bin/python" -m loadtests.raw_stats "$out/raw.jsonl" --by none
