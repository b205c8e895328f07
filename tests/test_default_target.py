"""The embedded default target: cache location, hash pinning, atomic install, offline reuse."""

from __future__ import annotations

from pathlib import Path

from mlx_spec import default_target as dt
from mlx_spec.errors import CheckpointError

import mlx.core as mx
import pytest

try:  # pytest's default "prepend" import mode puts tests/ on sys.path
    from test_gguf import tiny_model, train_tokenizer, write_gguf
except ImportError:
    from tests.test_gguf import tiny_model, train_tokenizer, write_gguf

# Greedy answer of the float32 default target (CPU backend), recorded on Linux x86_64, mlx 0.32.4.
PROMPT = "What is the capital of France?"
EXPECTED_F32 = "The capital of France is Paris."


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    tk = train_tokenizer()
    write_gguf(path, *tiny_model(tk.get_vocab_size()), tk)
    return path


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(dt.CACHE_ENV, str(tmp_path / "c"))
    assert dt.cache_dir() == tmp_path / "c"
    monkeypatch.delenv(dt.CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(dt.sys, "platform", "linux")
    assert dt.cache_dir() == tmp_path / ".cache" / "mlx_spec"
    monkeypatch.setattr(dt.sys, "platform", "darwin")
    assert dt.cache_dir() == tmp_path / "Library" / "Caches" / "mlx_spec"


def test_choose_dtype():
    assert dt.choose_dtype(True)[0] == "keep" and "Metal" in dt.choose_dtype(True)[1]
    assert dt.choose_dtype(False)[0] == "float32" and "CPU" in dt.choose_dtype(False)[1]


def test_install_target_is_atomic_and_checks_hash(tmp_path, tiny_gguf):
    dest = tmp_path / "models" / "tiny"
    with pytest.raises(CheckpointError, match="SHA-256"):
        dt.install_target(tiny_gguf, dest, sha256="0" * 64, dtype="float32")
    assert not (tmp_path / "models").exists() or list((tmp_path / "models").iterdir()) == []
    dest.mkdir(parents=True)
    (dest / "partial.bin").write_bytes(b"debris")
    out = dt.install_target(tiny_gguf, dest, sha256=dt.sha256_of(tiny_gguf), dtype="float32")
    assert not (dest / "partial.bin").exists()
    assert out == dest and (dest / "config.json").is_file() and (dest / "mlx_spec_source.json").is_file()
    assert [p.name for p in dest.parent.iterdir()] == ["tiny"]  # no temp dirs left behind


def test_ensure_converts_once_then_is_offline(monkeypatch, tmp_path, tiny_gguf):
    calls = []
    monkeypatch.setattr(dt, "installed_gguf", lambda: calls.append(1) or tiny_gguf)
    monkeypatch.setattr(dt, "GGUF_SHA256", dt.sha256_of(tiny_gguf))
    monkeypatch.setattr(dt, "gguf_from_wheel", lambda work: pytest.fail("must not fetch the wheel"))
    messages = []
    first = dt.ensure_default_target(tmp_path, progress=messages.append)
    assert first.dtype == dt.choose_dtype(mx.metal.is_available())[0]
    assert first.path.parent == tmp_path / "models" and (first.path / "model.safetensors").is_file()
    assert any("Converting" in m for m in messages)
    second = dt.ensure_default_target(tmp_path)
    assert second == first and calls == [1]
    assert dt.resolve_target_id(dt.DEFAULT_TARGET_ID, cache_dir=tmp_path) == first.path
    assert dt.resolve_target_id("org/some-model", cache_dir=tmp_path) is None


def test_installed_gguf_found_without_importing(monkeypatch, tmp_path):
    package = tmp_path / dt.GGUF_PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (package / dt.GGUF_NAME).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert dt.installed_gguf() == package / dt.GGUF_NAME


@pytest.mark.slow
@pytest.mark.registry
def test_real_default_target_greedy():
    from mlx_lm import generate, load

    target = dt.ensure_default_target()
    model, tokenizer = load(str(target.path))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    text = generate(model, tokenizer, prompt, max_tokens=24)
    if target.dtype == "float32":
        assert text == EXPECTED_F32
    else:  # the 4-bit Metal variant may round differently
        assert "Paris" in text
