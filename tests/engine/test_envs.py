"""rayinfer.envs: the declared process-level variables, read in one place and forwarded as set."""

from pathlib import Path

import pytest

from rayinfer import envs


def test_cache_dir_follows_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYINFER_CACHE", str(tmp_path))
    assert envs.cache_dir() == tmp_path
    monkeypatch.delenv("RAYINFER_CACHE")
    assert envs.cache_dir() == Path.home() / ".cache" / "rayinfer"


def test_only_the_declared_variables_set_here_are_forwarded(monkeypatch):
    for var in envs.DECLARED:
        monkeypatch.delenv(var.name, raising=False)
    monkeypatch.setenv("NCCL_SHM_DISABLE", "1")
    monkeypatch.setenv("SOMETHING_ELSE", "x")
    assert envs.forwarded() == {"NCCL_SHM_DISABLE": "1"}
    assert envs.nccl_settings() == ("", "1")


def test_a_child_process_gets_declared_overrides_only():
    env = envs.subprocess_env(NCCL_P2P_DISABLE="1")
    assert env["NCCL_P2P_DISABLE"] == "1"
    with pytest.raises(ValueError, match=r"\['RAYINFER_PROTOCOL'\] are not declared; declared: "):
        envs.subprocess_env(RAYINFER_PROTOCOL="cpu")


def test_every_declared_variable_has_a_doc():
    assert all(var.doc and var.name.isupper() for var in envs.DECLARED)
