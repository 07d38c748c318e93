"""Start vLLM on the GPU machine for a few configs and keep the log lines the memory model is checked against.

Run there (after the bundle install of shared/device/README.md), with one folder per model holding its
catalogue config.json (``serve_app/catalogue/<org>__<name>.json`` copied as ``<dir>/config.json``)::

    OUT=/tmp/out python3 measure_vllm_memory.py models/qwen3-8b:256:2048 models/qwen3-0.6b:256:8192

Each argument is ``model_dir:max_num_seqs:max_num_batched_tokens``. Every engine runs with dummy weights, no
tokenizer, gpu_memory_utilization 0.9, max_model_len 8192 and prefix caching, and is killed as soon as it
logs its KV cache size (the graph capture and warm-up that follow do not change the budget). Logs land in
``$OUT/<name>.log``; turn the interesting lines into a fixture JSON in this folder.
"""

import os
import re
import signal
import subprocess
import sys
import time

PER_ENGINE_LIMIT_S = 170


def main() -> None:
    out = os.environ["OUT"]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="DEBUG", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; p = torch.cuda.get_device_properties(0); print(p.name, p.total_memory)",
        ],
        check=False,
    )
    for arg in sys.argv[1:]:
        model_dir, seqs, budget = arg.rsplit(":", 2)
        name = f"{os.path.basename(model_dir.rstrip('/'))}_s{seqs}_t{budget}"
        code = (
            "from vllm import LLM\n"
            f"LLM(model={os.path.abspath(model_dir)!r}, load_format='dummy', skip_tokenizer_init=True,"
            f" gpu_memory_utilization=0.9, max_model_len=8192, max_num_seqs={seqs},"
            f" max_num_batched_tokens={budget}, enable_prefix_caching=True)\n"
        )
        log_path = os.path.join(out, name + ".log")
        start = time.time()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-c", code],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            while proc.poll() is None and time.time() - start < PER_ENGINE_LIMIT_S:
                time.sleep(1)
                with open(log_path, errors="replace") as f:
                    if re.search(r"KV cache size: [\d,]+ tokens", f.read()):
                        break
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # only the engine this script started
                proc.wait()
        print(name, f"{time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
