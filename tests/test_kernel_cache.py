"""The `outrider` command keeps MLX's compiled CUDA kernels where they outlive a reboot
(core/paths.py `keep_kernels`): in outrider's cache, per MLX version, unless the user chose a
folder with MLX_PTX_CACHE_DIR, and never where the folder cannot be made."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
from cli_runner import module_env

from outrider.core import paths


def test_the_kernels_go_to_outriders_cache_unless_a_folder_was_chosen(tmp_path, monkeypatch):
    monkeypatch.setenv("OUTRIDER_CACHE", str(tmp_path / "cache"))
    env: dict[str, str] = {}
    want = tmp_path / "cache" / "mlx" / mx.__version__ / "ptx"
    assert paths.keep_kernels(env) == str(want) == env[paths.PTX_CACHE_ENV]
    assert not want.exists()  # MLX makes it at its first compile: --help leaves no trace
    chosen = {paths.PTX_CACHE_ENV: str(tmp_path / "mine")}
    assert paths.keep_kernels(chosen) == str(tmp_path / "mine")
    assert chosen == {paths.PTX_CACHE_ENV: str(tmp_path / "mine")}


def test_a_cache_that_cannot_be_made_leaves_mlxs_default(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("OUTRIDER_CACHE", str(blocker / "cache"))  # under a file
    env: dict[str, str] = {}
    assert paths.keep_kernels(env) is None and env == {}


def test_the_command_sets_the_folder_before_it_runs(tmp_path):
    """A real `python -m outrider doctor --json` without MLX_PTX_CACHE_DIR: the command's own
    process points MLX at outrider's cache, and the doctor says so."""
    env = module_env({"OUTRIDER_CACHE": str(tmp_path)})
    env.pop(paths.PTX_CACHE_ENV, None)
    done = subprocess.run(
        [sys.executable, "-m", "outrider", "doctor", "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)["cuda_kernel_cache"]
    assert shown.endswith(str(tmp_path / "mlx" / mx.__version__ / "ptx"))
