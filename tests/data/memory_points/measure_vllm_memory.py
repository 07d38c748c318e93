"""Start vLLM on the GPU machine for a few configs and keep the log lines the memory model is checked against.

Run there from the repository root (after the bundle install of shared/device/README.md)::

    OUT=/tmp/out python3 tests/data/memory_points/measure_vllm_memory.py \
        q8b_fp8kv:Qwen/Qwen3-8B:mnbt=2048,kv=fp8 \
        q30b_a3b:Qwen/Qwen3-30B-A3B:mnbt=2048 \
        q8b_tp2_eager:Qwen/Qwen3-8B:mnbt=2048,tp=2,eager=1

Each argument is ``name:catalogue-model:options``; options (comma separated ``key=value``):
``seqs`` (max_num_seqs, 256), ``mnbt`` (max_num_batched_tokens, 2048), ``mml`` (max_model_len, 8192),
``kv`` (kv_cache_dtype, auto), ``tp`` (tensor_parallel_size, 1), ``eager=1`` (enforce_eager=True),
``backend`` (distributed_executor_backend), ``nofuse=1`` (compilation_config with the flashinfer
all-reduce + RMSNorm fusion pass off). The catalogue's ``serve_app/catalogue/<org>__<name>.json`` becomes the
model folder's config.json. Every engine runs with dummy weights, no tokenizer, gpu_memory_utilization 0.9
and prefix caching, and is killed as soon as it logs its KV cache size (the graph capture and warm-up that
follow do not change the budget). The exact ``LLM(...)`` call heads each log in ``$OUT/<name>.log``;
``$OUT/results.json`` lists, per engine, the call, the seconds, whether the KV line came and the log lines
that matter. Turn them into a fixture JSON in this folder.

The first version of this script (five Qwen3 points, 2026-11-29) took ``model_dir:max_num_seqs:mnbt``.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

PER_ENGINE_LIMIT_S = 240
TOTAL_LIMIT_S = int(os.environ.get("MEASURE_TOTAL_LIMIT_S", "520"))
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
PATTERNS = (
    "non-default args",
    "worker init memory snapshot",
    "worker requested memory",
    "Model loading took",
    "Memory profiling takes",
    "Available KV cache memory",
    "KV cache size",
    "Maximum concurrency",
    "Error",
    "error",
    "illegal",
)


def engine_code(model_dir: str, opts: dict[str, str]) -> str:
    args = [
        f"model={model_dir!r}",
        "load_format='dummy'",
        "skip_tokenizer_init=True",
        "gpu_memory_utilization=0.9",
        f"max_model_len={int(opts.get('mml', 8192))}",
        f"max_num_seqs={int(opts.get('seqs', 256))}",
        f"max_num_batched_tokens={int(opts.get('mnbt', 2048))}",
        "enable_prefix_caching=True",
    ]
    if opts.get("kv", "auto") != "auto":
        args.append(f"kv_cache_dtype={opts['kv']!r}")
    if int(opts.get("tp", 1)) != 1:
        args.append(f"tensor_parallel_size={int(opts['tp'])}")
    if opts.get("eager") == "1":
        args.append("enforce_eager=True")
    if opts.get("backend"):
        args.append(f"distributed_executor_backend={opts['backend']!r}")
    if opts.get("nofuse") == "1":
        args.append("compilation_config={'pass_config': {'fuse_allreduce_rms': False}}")
    return "from vllm import LLM\nLLM(" + ", ".join(args) + ")\n"


def wait_gpus_free(limit_s: float = 30.0) -> str:
    """Wait until no GPU holds more than 2 GiB (the engines before are gone); return nvidia-smi's view."""
    deadline = time.time() + limit_s
    text = ""
    while time.time() < deadline:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=False,
        )
        text = done.stdout.strip()
        used = [int(line.split(",")[1]) for line in text.splitlines() if line.count(",") == 2]
        if used and max(used) < 2048:
            break
        time.sleep(1)
    return text


def main() -> None:
    out = os.environ["OUT"]
    t0 = time.time()
    env = dict(os.environ, VLLM_LOGGING_LEVEL="DEBUG", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, vllm; p = torch.cuda.get_device_properties(0);"
            " print(vllm.__version__, torch.__version__, torch.cuda.device_count(), p.name, p.total_memory)",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    results: dict[str, object] = {"probe": probe.stdout.strip() + probe.stderr[-2000:], "engines": []}
    print("probe:", results["probe"], flush=True)
    for arg in sys.argv[1:]:
        name, model, optstr = arg.split(":", 2)
        opts = dict(kv.split("=", 1) for kv in optstr.split(",") if kv)
        left = TOTAL_LIMIT_S - (time.time() - t0)
        if left < 60:
            print("skip", name, "(no time left)", flush=True)
            results["engines"].append({"name": name, "skipped": "no time left"})  # type: ignore[union-attr]
            continue
        model_dir = os.path.join("/tmp/models", name)
        os.makedirs(model_dir, exist_ok=True)
        shutil.copy(
            os.path.join(ROOT, "serve_app", "catalogue", model.replace("/", "__") + ".json"),
            os.path.join(model_dir, "config.json"),
        )
        code = engine_code(model_dir, opts)
        gpus_before = wait_gpus_free()
        log_path = os.path.join(out, name + ".log")
        start = time.time()
        with open(log_path, "w") as log:
            log.write(f"# {sys.executable} -c {code!r}\n# nvidia-smi before: {gpus_before}\n")
            log.flush()
            proc = subprocess.Popen(
                [sys.executable, "-c", code],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            done = False
            while proc.poll() is None and time.time() - start < min(PER_ENGINE_LIMIT_S, left):
                time.sleep(1)
                with open(log_path, errors="replace") as f:
                    if re.search(r"KV cache size: [\d,]+ tokens", f.read()):
                        done = True
                        time.sleep(1)
                        break
            rc = proc.poll()
            if rc is None:
                os.killpg(proc.pid, signal.SIGKILL)  # only the engine this script started (and its workers)
                proc.wait()
        if opts.get("backend") == "ray":
            subprocess.run(["ray", "stop", "--force"], capture_output=True, check=False, env=env)
        elapsed = round(time.time() - start)
        with open(log_path, errors="replace") as f:
            text = f.read()
        with open(log_path, errors="replace") as f:
            lines = [line.rstrip("\n") for line in f if any(p in line for p in PATTERNS)]
        tail = text.splitlines()[-60:]
        entry = {
            "name": name,
            "model": model,
            "options": opts,
            "code": code,
            "kv_line": done,
            "exit_code_before_kill": rc,
            "seconds": elapsed,
            "lines": lines[:80],
            "tail": [] if done else tail,
        }
        results["engines"].append(entry)  # type: ignore[union-attr]
        print(name, "KV LINE" if done else f"NO KV LINE (rc {rc})", elapsed, "s", flush=True)
        for line in lines[:40]:
            print("   ", line[-400:], flush=True)
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
