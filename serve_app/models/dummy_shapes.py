"""A catalogue model's shape as a local model directory, for serving it with random weights.

`model.source: Qwen/Qwen3-8B` with `model.dummy_weights: true` is how users measure a model's serving
behaviour (memory, latency, throughput) before its weights are available: vLLM builds the real architecture
from config.json and fills it with random values (`load_format=dummy`). vLLM still needs a tokenizer whose
ids cover the model's whole vocabulary, because random weights sample any id: a token it cannot decode is
streamed as empty text, which would hide tokens from every latency measurement. The tokenizer here is the
embedded model's byte-level BPE, extended with generated merges until it has exactly `vocab_size` tokens.

Deterministic and offline, like the embedded models; tokenizers/transformers are imported only to build.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from serve_app.models.embedded import GENERATOR_VERSION, build_tokenizer, cache_root
from serve_app.planning import catalogue


def shape_dir(name: str, root: Path | None = None) -> Path:
    resolved = catalogue.shape(name).name  # canonical "org/name"
    return (root or cache_root()) / "shapes" / f"{resolved.replace('/', '__')}-v{GENERATOR_VERSION}"


# Byte-level BPE writes printable ASCII as itself and a space as "Ġ". Tokens made only of these decode to
# whole characters on their own, so a streamed token is never held back as half a UTF-8 sequence.
_TEXT_CHARS = [chr(b) for b in range(33, 127)] + ["\u0120"]


def pad_vocabulary(tokenizer_json: dict, vocab_size: int) -> dict:
    """Adds BPE merges (a text token + one text character) until the tokenizer has `vocab_size` ids.

    The new merges come after the trained ones, so they apply only where no trained merge does; each new
    id decodes to plain text on its own.
    """
    model = tokenizer_json["model"]
    vocab: dict[str, int] = model["vocab"]
    added = {t["id"] for t in tokenizer_json.get("added_tokens", [])}
    next_id = max(set(vocab.values()) | added) + 1
    if next_id > vocab_size:
        raise ValueError(f"the base tokenizer already has {next_id} ids, more than {vocab_size}")
    merges = model["merges"]
    as_pairs = bool(merges) and isinstance(merges[0], list)
    text = set(_TEXT_CHARS)
    lefts = [t for t in sorted(vocab, key=vocab.__getitem__) if set(t) <= text]
    for left in lefts:  # grows as tokens are added, so there is always another candidate
        for right in _TEXT_CHARS:
            if next_id >= vocab_size:
                return tokenizer_json
            token = left + right
            if token in vocab:
                continue
            vocab[token] = next_id
            merges.append([left, right] if as_pairs else f"{left} {right}")
            lefts.append(token)
            next_id += 1
    return tokenizer_json


def ensure_shape_model(name: str, root: Path | None = None) -> Path:
    """The directory holding catalogue model `name`'s config.json and a tokenizer covering its vocabulary.

    Raises `catalogue.CatalogueKeyError` for a name the catalogue does not know. Written into a temporary
    sibling and renamed, so concurrent callers (driver and replicas on one node) never see half a model.
    """
    config = catalogue.get(name)
    target = shape_dir(name, root)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    build_tokenizer(tmp)
    path = tmp / "tokenizer.json"
    path.write_text(json.dumps(pad_vocabulary(json.loads(path.read_text()), config["vocab_size"])))
    # The tokenizer's own special tokens end generation; the checkpoint's ids (e.g. 151645) are not in it.
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config.pop(key, None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    try:
        tmp.rename(target)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return target
