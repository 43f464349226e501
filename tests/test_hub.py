"""Model resolution: local folders, LM Studio's folders, the Hugging Face cache, clear errors."""

from __future__ import annotations

import shutil

import pytest

from outrider.core.errors import ModelNotFoundError
from outrider.core.hub import looks_like_repo_id, resolve_model


def test_local_folder_wins(qwen3_target):
    assert resolve_model(str(qwen3_target)) == qwen3_target


def test_lmstudio_folder_is_reused(qwen3_target, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    folder = tmp_path / ".lmstudio" / "models" / "someone" / "tiny-qwen3-mlx"
    shutil.copytree(qwen3_target, folder)
    assert resolve_model("someone/tiny-qwen3-mlx", download=False) == folder


def test_missing_repo_offline_names_repo_and_remedy(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match=r"nobody/nothing .*`hf download nobody/nothing`"):
        resolve_model("nobody/nothing")


def test_offline_remedy_is_the_hf_command(tmp_path, monkeypatch):
    """huggingface-hub 1.x has no `huggingface-cli`; the message leads with its `hf download`,
    and names the old command only for releases before 0.34, which lack `hf`."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for spec, args in (
        ("nobody/nothing", "nobody/nothing"),
        ("gguf:someone/repo/x.gguf", "someone/repo x.gguf"),
    ):
        with pytest.raises(ModelNotFoundError) as caught:
            resolve_model(spec)
        message = str(caught.value)
        assert f"run `hf download {args}` on a connected machine" in message
        assert message.count("huggingface-cli") == 1
        assert f"huggingface-hub before 0.34: `huggingface-cli download {args}`" in message


def test_file_and_bad_ids_are_refused(qwen3_target):
    with pytest.raises(ModelNotFoundError, match="is a file"):
        resolve_model(str(qwen3_target / "config.json"))
    with pytest.raises(ModelNotFoundError, match="no such folder"):
        resolve_model("just-a-name")
    assert looks_like_repo_id("org/name") and not looks_like_repo_id("./org/name")
