"""The embedded models are generated deterministically; mismatched drafts are refused before any start."""

from __future__ import annotations

import json
import shutil

import pytest

from serve_app.config import ConfigError, deep_merge, load_env_config, parse_config
from serve_app.models.embedded import digest, ensure_embedded_model
from serve_app.models.resolve import check_draft_compatible, resolve_models, resolve_source


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("headroom-home")


@pytest.fixture(scope="module")
def target(home):
    return ensure_embedded_model("embedded:tiny-qwen3", home)


@pytest.fixture(scope="module")
def draft(home):
    return ensure_embedded_model("embedded:tiny-qwen3-draft", home)


def test_generation_is_deterministic(target, tmp_path):
    again = ensure_embedded_model("embedded:tiny-qwen3", tmp_path)
    assert digest(again) == digest(target)
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["num_hidden_layers"] == 2
    assert cfg["hidden_size"] == 128 and cfg["dtype"] == "bfloat16"
    assert (target / "tokenizer.json").is_file() and (target / "chat_template.jinja").is_file()


def test_tokenizer_round_trips_any_text_and_has_a_chat_template(target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    text = "SELECT id FROM users; 你好 ✓"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: nothing is unknown
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_embedded_draft_is_compatible(target, draft):
    check_draft_compatible(target, draft, "draft_model")


def test_draft_of_another_family_is_refused(target, draft, tmp_path):
    llama = tmp_path / "llama-draft"
    shutil.copytree(draft, llama)
    cfg = json.loads((llama / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
    (llama / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        check_draft_compatible(target, llama, "draft_model")
    assert err.value.problems[0][0] == "engine.speculative.draft_model"
    assert "'llama' differs from the target's 'qwen3'" in str(err.value)


def test_draft_with_another_tokenizer_is_refused(target, draft, tmp_path):
    other = tmp_path / "other-tokenizer"
    shutil.copytree(draft, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first + "x"] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="tokenizer differs"):
        check_draft_compatible(target, other, "draft_model")


def test_same_family_is_accepted_across_moe_variants():
    from serve_app.models.resolve import architecture_family

    assert architecture_family("qwen3_moe") == architecture_family("qwen3") == "qwen3"
    assert architecture_family("llama") != architecture_family("qwen3")


def test_missing_model_directory_names_the_field(tmp_path):
    with pytest.raises(ConfigError) as err:
        resolve_source(str(tmp_path / "nope"), "model.source")
    assert err.value.problems[0][0] == "model.source"
    assert "never downloads" in str(err.value)


def test_unknown_embedded_model_lists_the_available_ones():
    with pytest.raises(ConfigError, match="embedded:tiny-qwen3-draft"):
        resolve_source("embedded:huge", "model.source")


def test_resolve_models_checks_the_draft(home, monkeypatch, tmp_path, target, draft):
    monkeypatch.setenv("HEADROOM_HOME", str(home))
    llama = tmp_path / "llama"
    shutil.copytree(draft, llama)
    cfg_json = json.loads((llama / "config.json").read_text())
    cfg_json["model_type"] = "llama"
    (llama / "config.json").write_text(json.dumps(cfg_json))
    base = load_env_config("local").model_dump(mode="json")
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "draft_model": str(llama)}
    with pytest.raises(ConfigError, match="architecture family"):
        resolve_models(parse_config(deep_merge(base, {"engine": {"speculative": spec}})))
    spec["draft_model"] = "embedded:tiny-qwen3-draft"
    models = resolve_models(parse_config(deep_merge(base, {"engine": {"speculative": spec}})))
    assert models.draft_path == str(draft)


def test_catalogue_name_without_dummy_weights_says_how_to_serve_it(home, monkeypatch):
    monkeypatch.setenv("HEADROOM_HOME", str(home))
    with pytest.raises(ConfigError) as err:
        resolve_source("Qwen/Qwen3-8B", "model.source")
    assert err.value.problems[0][0] == "model.source"
    assert "model.dummy_weights: true" in str(err.value)
    assert not (home / "shapes").exists()  # nothing written for a refused config


def test_unknown_name_lists_the_catalogue(home, monkeypatch):
    monkeypatch.setenv("HEADROOM_HOME", str(home))
    with pytest.raises(ConfigError, match="Qwen/Qwen3-8B") as err:
        resolve_source("Qwen/Qwen3-9B", "model.source", dummy_weights=True)
    assert "Did you mean" in str(err.value)


def test_dummy_weights_serve_a_catalogue_shape_with_a_tokenizer_covering_its_vocabulary(home, monkeypatch):
    from transformers import AutoTokenizer

    from serve_app.planning import catalogue

    monkeypatch.setenv("HEADROOM_HOME", str(home))
    path = resolve_source("qwen/qwen3-0.6b", "model.source", dummy_weights=True)
    published = catalogue.get("Qwen/Qwen3-0.6B")
    written = json.loads((path / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim", "vocab_size"):
        assert written[key] == published[key]
    tok = AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == published["vocab_size"] == 151936
    # Random weights sample any id: each one must decode to text, or streamed tokens would go missing.
    ids = list(range(0, published["vocab_size"], 97)) + [published["vocab_size"] - 1]
    assert all(tok.decode([i]) for i in ids)
    text = "SELECT name FROM users WHERE id > 3;"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert resolve_source("Qwen/Qwen3-0.6B", "model.source", dummy_weights=True) == path  # cached


def test_padded_tokens_decode_to_whole_characters(home, monkeypatch):
    """A token that is half a UTF-8 character would be held back by vLLM's streaming detokenizer."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("HEADROOM_HOME", str(home))
    tok = AutoTokenizer.from_pretrained(str(resolve_source("Qwen/Qwen3-0.6B", "model.source", True)))
    for i in range(4096, 151936, 1009):
        text = tok.decode([i])
        assert text and "\ufffd" not in text and text.isascii()
