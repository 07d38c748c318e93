"""Finding a config's model files and checking that a draft model can draft for its target.

Reads files only (config.json, tokenizer.json); imports neither vLLM nor Ray, so it runs at the edge, before
anything starts.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from serve_app.config import ConfigError, HeadroomConfig
from serve_app.config.vocabulary import SEPARATE_TOKENIZER_METHODS, is_embedded
from serve_app.models.dummy_shapes import ensure_shape_model
from serve_app.models.embedded import ensure_embedded_model
from serve_app.planning import catalogue


@dataclass(frozen=True)
class ResolvedModels:
    """Local paths of the target and draft model, once `embedded:` names have been generated."""

    model_path: str
    draft_path: str | None = None


def resolve_source(source: str, field: str, dummy_weights: bool = False) -> Path:
    """A local model directory for `source`: an embedded model (generated on first use), a local checkpoint,
    or, with dummy weights, a catalogue model's shape (config.json and a tokenizer, generated)."""
    if is_embedded(source):
        try:
            return ensure_embedded_model(source)
        except ValueError as err:
            raise ConfigError([(field, str(err))]) from None
    path = Path(source).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()
    try:
        catalogue.get(source)
    except catalogue.CatalogueKeyError as err:
        problem = (
            f"{source!r} is neither a local model directory (no config.json there) nor a catalogue name; "
            f"headroom never downloads weights. {err}"
        )
        raise ConfigError([(field, problem)]) from None
    if dummy_weights:
        return ensure_shape_model(source)
    raise ConfigError(
        [
            (
                field,
                f"{source!r} is a catalogue name, and headroom never downloads weights: set "
                "model.dummy_weights: true to serve its shape with random weights (memory, latency and "
                "throughput are real, the text is not), or give the local directory of its checkpoint",
            )
        ]
    )


def architecture_family(model_type: str) -> str:
    """qwen3, qwen3_moe and qwen3_next are one family; llama and llama4 are not the same as qwen3."""
    return re.sub(r"(_moe|_next|_vl|_text|_mtp)+$", "", model_type.lower())


def tokenizer_fingerprint(model_dir: Path) -> str | None:
    """sha256 of the tokenizer's vocabulary and added tokens, or None when there is no tokenizer.json."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    vocab = data.get("model", {}).get("vocab", {})
    added = sorted((t["id"], t["content"]) for t in data.get("added_tokens", []))
    return hashlib.sha256(json.dumps([sorted(vocab.items()), added]).encode()).hexdigest()


def check_draft_compatible(target_dir: Path, draft_dir: Path, method: str) -> None:
    """Refuses a draft whose tokenizer or architecture family differs from the target's.

    A mismatched draft either crashes vLLM or proposes tokens that are never accepted (the seeds' pitfall:
    a Llama draft for a Qwen target), so this fails before any engine starts.
    """
    field = "engine.speculative.draft_model"
    target = json.loads((target_dir / "config.json").read_text())
    draft = json.loads((draft_dir / "config.json").read_text())
    problems = []
    # EAGLE-style heads read the target's hidden states and share its embedding: only the vocabulary
    # has to agree for them.
    if method in SEPARATE_TOKENIZER_METHODS:
        t_family = architecture_family(target.get("model_type", "?"))
        d_family = architecture_family(draft.get("model_type", "?"))
        if t_family != d_family:
            problems.append(
                f"draft architecture family {d_family!r} differs from the target's {t_family!r}; "
                "a draft must be of the target's family (e.g. Qwen3-0.6B for Qwen3-8B)"
            )
        t_tok, d_tok = tokenizer_fingerprint(target_dir), tokenizer_fingerprint(draft_dir)
        if t_tok is not None and d_tok is not None and t_tok != d_tok:
            problems.append(
                "draft tokenizer differs from the target's (different vocabulary or special tokens)"
            )
    t_vocab, d_vocab = target.get("vocab_size"), draft.get("vocab_size")
    if t_vocab != d_vocab:
        problems.append(f"draft vocab_size ({d_vocab}) differs from the target's ({t_vocab})")
    if problems:
        raise ConfigError([(field, "; ".join(problems) + f" [target {target_dir}, draft {draft_dir}]")])


def resolve_models(cfg: HeadroomConfig) -> ResolvedModels:
    """Local paths for the config's model and draft, checked for compatibility."""
    dummy = cfg.model.dummy_weights
    model_path = resolve_source(cfg.model.source, "model.source", dummy)
    spec = cfg.engine.speculative
    draft_path = None
    if spec is not None and spec.draft_model:
        # vLLM's load_format applies to the draft as well: with dummy weights both are random.
        draft_path = resolve_source(spec.draft_model, "engine.speculative.draft_model", dummy)
        check_draft_compatible(model_path, draft_path, spec.method)
    return ResolvedModels(str(model_path), str(draft_path) if draft_path else None)
