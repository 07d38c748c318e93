"""The load of the profiles: `vllm bench serve` in-process (the CPU build has no `vllm` script).

PORT=8000 N=3000 python results/gpu/2026-12-02d/cpu-profile/load.py   (headroom; 8310: vllm serve)
"""

import os

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

env = os.environ.get
parser = FlexibleArgumentParser()
add_cli_args(parser)
argv = [
    "--backend", "openai", "--endpoint", "/v1/completions",
    "--base-url", f"http://127.0.0.1:{env('PORT', '8000')}",
    "--model", "tiny-qwen3", "--tokenizer", "/root/.cache/headroom/models/tiny-qwen3-v1",
    "--dataset-name", "random", "--random-input-len", env("INLEN", "50"),
    "--random-output-len", env("OUTLEN", "2"), "--num-prompts", env("N", "640"),
    "--max-concurrency", env("C", "32"), "--ignore-eos", "--temperature", "0", "--seed", "1",
    "--disable-tqdm", "--percentile-metrics", "ttft,e2el",
]  # fmt: skip
main(parser.parse_args(argv))
