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


def test_model_dirs_are_searched_by_repo_id(qwen3_target, tmp_path, monkeypatch):
    """OUTRIDER_MODEL_DIRS (os.pathsep-separated), and mlx-dspark's model folders for users
    moving over, hold models as owner/name, owner_name or name; the picker lists them."""
    import os

    from outrider.core.hub import model_roots
    from outrider.server.web import _folder_models

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    first, second = tmp_path / "a", tmp_path / "b"
    shutil.copytree(qwen3_target, first / "someone_tiny")  # owner_name
    shutil.copytree(qwen3_target, second / "other")  # name alone
    monkeypatch.setenv("OUTRIDER_MODEL_DIRS", f"{tmp_path / 'missing'}{os.pathsep}{first}")
    monkeypatch.setenv("MLX_DSPARK_MODEL_DIRS", str(second))
    assert resolve_model("someone/tiny", download=False) == first / "someone_tiny"
    assert resolve_model("anyone/other", download=False) == second / "other"
    with pytest.raises(ModelNotFoundError):
        resolve_model("someone/absent", download=False)
    sources = [source for _, source in model_roots()]
    assert sources[:3] == ["OUTRIDER_MODEL_DIRS", "OUTRIDER_MODEL_DIRS", "MLX_DSPARK_MODEL_DIRS"]
    listed = {(m["name"], m["source"]) for m in _folder_models()}
    assert {("someone_tiny", "OUTRIDER_MODEL_DIRS"), ("other", "MLX_DSPARK_MODEL_DIRS")} <= listed


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


# --- downloads: progress, Ctrl-C, the fit warning (huggingface_hub faked: no network) ---------


def _fake_hub(monkeypatch, tmp_path, snapshot):
    """No cache, network allowed in name only: `snapshot` stands in for snapshot_download."""
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def fake(repo_id, local_files_only=False, tqdm_class=None, **kwargs):
        if local_files_only:
            raise FileNotFoundError(repo_id)  # not in the cache
        return snapshot(repo_id, tqdm_class)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)


def _drive(tqdm_class, chunks, size=1000, sleep=0.0, seen=None, folder="/nonexistent"):
    """What huggingface_hub >= 1.x does: a files bar, a received-bytes bar and a written-bytes
    bar whose totals grow as each file's size is known."""
    import time

    files = tqdm_class(desc="Fetching 2 files", total=2)
    transfer = tqdm_class(desc="Downloading bytes", total=0, unit="B", unit_scale=True)
    written = tqdm_class(desc="Reconstructing", total=0, unit="B", unit_scale=True)
    for bar in (transfer, written):
        bar.total = chunks * size
    try:
        for _ in range(chunks):
            written.update(size)
            transfer.update(size)
            if seen is not None:
                seen["chunks"] = seen.get("chunks", 0) + 1
            time.sleep(sleep)
    except BaseException as e:
        if seen is not None:
            seen["stopped_by"] = type(e).__name__
        raise
    files.update(2)
    for bar in (files, transfer, written):
        bar.close()
    return str(folder)


def test_progress_reaches_the_watcher_and_prints_nothing(tmp_path, monkeypatch, capsys):
    from outrider.core import fit, hub

    monkeypatch.setattr(fit, "download_warning", lambda *a, **k: None)
    _fake_hub(
        monkeypatch, tmp_path, lambda repo, tqdm_class: _drive(tqdm_class, 5, folder=tmp_path)
    )

    class Recorder(hub.DownloadWatcher):
        def __init__(self):
            self.updates, self.ended = [], None

        def update(self, state):
            self.updates.append(state.as_dict())

        def end(self, state, ok):
            self.ended = (state.as_dict(), ok)

    watcher = Recorder()
    with hub.watch_downloads(watcher):
        assert hub.resolve_model("someone/tiny") == tmp_path
    final, ok = watcher.ended
    assert ok and final["repo"] == "someone/tiny" and final["what"] == "model"
    # received and written bytes are one download, not two: 5 chunks of 1000 bytes
    assert final["bytes_done"] == final["bytes_total"] == 5000 and final["fraction"] == 1.0
    assert final["files_done"] == final["files_total"] == 2
    assert watcher.updates and all(u["bytes_done"] <= 5000 for u in watcher.updates)
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""  # the forwarding tqdm draws nothing itself


def test_the_adapter_counts_a_single_file_download():
    from outrider.core.hub import DownloadState, ProgressSink

    got = []
    sink = ProgressSink(DownloadState("o/r", file="m.gguf"), got.append, interval=0)
    bar = sink.tqdm_class(desc="m.gguf", total=300, unit="B", initial=100)
    bar.update(50)
    bar.update(150)
    bar.close()
    assert got[-1].done == 300 and got[-1].total == 300 and got[-1].file == "m.gguf"


def test_terminal_watcher_prints_plain_lines_off_a_terminal(tmp_path, monkeypatch, capsys):
    from outrider.core import fit, hub

    monkeypatch.setattr(fit, "download_warning", lambda *a, **k: None)
    _fake_hub(
        monkeypatch, tmp_path, lambda repo, tqdm_class: _drive(tqdm_class, 3, folder=tmp_path)
    )
    hub.resolve_model("someone/tiny")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "downloading someone/tiny …"
    assert lines[1].startswith("downloaded someone/tiny (0.0 GB in ")


@pytest.mark.usefixtures("ctrl_c_as_in_a_terminal")
def test_ctrl_c_stops_the_download_at_once(tmp_path, monkeypatch):
    """Ctrl-C lands in the waiting thread; the download thread stops at its next chunk."""
    import _thread
    import threading
    import time

    from outrider.core import fit, hub

    monkeypatch.setattr(fit, "download_warning", lambda *a, **k: None)
    seen: dict = {}

    def snapshot(repo, tqdm_class):  # Ctrl-C 50 ms into a 10 s download
        threading.Timer(0.05, _thread.interrupt_main).start()
        seen["started"] = time.monotonic()
        return _drive(tqdm_class, 2000, sleep=0.005, seen=seen)

    _fake_hub(monkeypatch, tmp_path, snapshot)
    with pytest.raises(KeyboardInterrupt), hub.watch_downloads(hub.DownloadWatcher()):
        hub.resolve_model("someone/big")
    assert time.monotonic() - seen["started"] < 2
    assert seen.get("stopped_by") == "DownloadCancelled" and seen["chunks"] < 2000, seen


@pytest.mark.usefixtures("ctrl_c_as_in_a_terminal")
def test_ctrl_c_during_a_download_exits_130(tmp_path, monkeypatch):
    import _thread

    from typer.testing import CliRunner

    from outrider.cli import app
    from outrider.core import fit

    monkeypatch.setattr(fit, "download_warning", lambda *a, **k: None)

    def interrupted(repo, tqdm_class):
        _thread.interrupt_main()
        return _drive(tqdm_class, 2000, sleep=0.005)

    _fake_hub(monkeypatch, tmp_path, interrupted)
    out = CliRunner().invoke(app, ["generate", "--model", "someone/big", "--prompt", "hi"])
    assert out.exit_code == 130 and "interrupted" in out.output


def test_the_fit_warning_is_one_line_before_the_download(tmp_path, monkeypatch, capsys):
    from outrider.core import fit, hub

    config = {"num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 8}
    config["max_position_embeddings"] = 1000
    monkeypatch.setattr(fit, "hub_weight_bytes", lambda repo: 30 * 10**9)
    monkeypatch.setattr(fit, "hub_config", lambda repo: config)
    memory = {"bytes": 16 * 10**9}
    monkeypatch.setattr(fit, "machine_memory", lambda: (memory["bytes"], "RAM"))
    _fake_hub(monkeypatch, tmp_path, lambda repo, tqdm_class: str(tmp_path))
    hub.resolve_model("someone/huge")
    err = capsys.readouterr().err.splitlines()
    warnings = [line for line in err if line.startswith("warning:")]
    assert len(warnings) == 1 and err.index(warnings[0]) < err.index("downloading someone/huge …")
    assert warnings[0].startswith("warning: someone/huge will likely not fit in this machine's")
    assert "30.0 GB weights + 0.1 MB KV cache at 1,000 tokens" in warnings[0]
    assert "16.0 GB of RAM; downloading anyway" in warnings[0]
    memory["bytes"] = 64 * 10**9  # it fits: no warning
    hub.resolve_model("someone/huge")
    assert "warning" not in capsys.readouterr().err


def test_a_half_downloaded_snapshot_is_not_local(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from outrider.core.hub import local_model

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--half"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (repo / "blobs").mkdir()
    assert local_model("someone/half") == snap
    (repo / "blobs" / "abc.incomplete").write_bytes(b"x")  # a download that was stopped
    assert local_model("someone/half") is None
    (repo / "blobs" / "abc.incomplete").unlink()
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    (snap / "model.safetensors.index.json").write_text(__import__("json").dumps(index))
    (snap / "model-1.safetensors").write_bytes(b"")
    assert local_model("someone/half") is None  # a shard is missing
    (snap / "model-2.safetensors").write_bytes(b"")
    assert local_model("someone/half") == snap
