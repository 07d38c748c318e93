"""The embedded default model: a tiny Qwen3 (and a smaller Qwen3 draft) that headroom generates itself.

Everything is derived from fixed seeds and text generated here, so two machines produce byte-identical
files and nothing is downloaded. The weights are random: the text is meaningless, but every byte goes
through vLLM's normal model-loading and serving code, which is what the embedded default is for.

torch, tokenizers and transformers are imported inside the functions that need them: the CLI imports this
module to resolve paths without paying for them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

from serve_app.planning.catalogue import (
    EMBEDDED_MAX_POSITION_EMBEDDINGS,
    EMBEDDED_MODELS,
    EMBEDDED_VOCAB_SIZE,
    embedded_config,
    embedded_name,
)

# Bump when anything below changes what is generated; the cache directory is keyed on it.
GENERATOR_VERSION = 1

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen3 uses it; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The prose words of the tokenizer's training corpus (its JSON values too).
CORPUS_WORDS = (
    "the a model server request token cache prefix batch latency memory throughput replica "
    "engine queue first time per output user system prompt answer question deploy scale budget "
    "fast slow under over with from into and or not when while because so then this that each "
    "every some"
).split()
# Identifiers of the corpus's code, SQL and JSON lines.
CORPUS_NAMES = "user order item price total count id name city status created_at amount".split()


def cache_root() -> Path:
    """Where generated models live: $HEADROOM_HOME, else ~/.cache/headroom."""
    return Path(os.environ.get("HEADROOM_HOME", Path.home() / ".cache" / "headroom"))


def model_dir(name: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / "models" / f"{name}-v{GENERATOR_VERSION}"


def training_corpus(seed: int = 0, lines: int = 6000) -> list[str]:
    """Deterministic mixed text (prose, code, SQL, JSON) for the BPE tokenizer to learn merges from."""
    rng = random.Random(seed)
    words, names = CORPUS_WORDS, CORPUS_NAMES
    out: list[str] = []
    for i in range(lines):
        kind = i % 4
        if kind == 0:
            sentence = " ".join(rng.choice(words) for _ in range(rng.randint(6, 16)))
            out.append(sentence.capitalize() + rng.choice([".", "?", "!"]))
        elif kind == 1:
            fn, arg = rng.choice(names), rng.choice(names)
            out.append(f"def get_{fn}({arg}):\n    return {arg}.{rng.choice(names)} + {rng.randint(0, 99)}\n")
        elif kind == 2:
            cols = ", ".join(rng.sample(names, 3))
            out.append(
                f"SELECT {cols} FROM {rng.choice(names)}s WHERE {rng.choice(names)} > {rng.randint(0, 999)};"
            )
        else:
            obj = {
                k: rng.choice([rng.randint(0, 9999), rng.choice(words), True, None])
                for k in rng.sample(names, 3)
            }
            out.append(json.dumps(obj))
    return out


def build_tokenizer(out_dir: Path) -> int:
    """Trains a byte-level BPE on the generated corpus and writes HF tokenizer files. Returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=EMBEDDED_VOCAB_SIZE - 64,  # leave room below the model's vocab for added tokens
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS,
        model_max_length=EMBEDDED_MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return len(fast)


def build_model(name: str, out_dir: Path) -> None:
    """Writes config.json, generation_config.json and bf16 safetensors with seeded random weights."""
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    shape = EMBEDDED_MODELS[name]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    config = Qwen3Config(
        **embedded_config(name),
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )
    torch.manual_seed(shape.seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(str(out_dir))


def ensure_embedded_model(source: str, root: Path | None = None) -> Path:
    """Returns the directory of an embedded model, generating it first if it is not there yet.

    Generation writes into a temporary sibling and renames it, so concurrent callers (the driver and
    replicas on one node) never see a half-written model.
    """
    name = embedded_name(source)
    target = model_dir(name, root)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
    tmp.mkdir(exist_ok=True)
    build_tokenizer(tmp)
    build_model(name, tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race; its copy is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


def digest(directory: Path) -> str:
    """sha256 over the files of a model directory, for checking that generation is deterministic."""
    h = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()
