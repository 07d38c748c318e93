import sys, os
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser(); add_cli_args(p)
port = os.environ.get("PORT", "8000"); n = os.environ.get("N", "640"); out = os.environ.get("OUTLEN", "2"); inl = os.environ.get("INLEN", "50"); c=os.environ.get("C","32")
a = p.parse_args(f"--backend openai --endpoint /v1/completions --base-url http://127.0.0.1:{port} --model tiny-qwen3 --tokenizer /root/.cache/headroom/models/tiny-qwen3-v1 --dataset-name random --random-input-len {inl} --random-output-len {out} --num-prompts {n} --max-concurrency {c} --ignore-eos --temperature 0 --seed 1 --disable-tqdm --percentile-metrics ttft,e2el".split())
main(a)
