"""Where built-in models live: one folder several PDSERVE_HOMEs can share ($PDSERVE_MODELS), else per home."""

from __future__ import annotations

from pdserve.state.folder import models_dir


def test_models_live_under_the_home_by_default(monkeypatch, tmp_path):
    monkeypatch.delenv("PDSERVE_MODELS", raising=False)
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    assert models_dir() == tmp_path / "home" / "models"


def test_pdserve_models_is_shared_by_every_home(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_MODELS", str(tmp_path / "shared"))
    for home in ("a", "b"):
        monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / home))
        assert models_dir() == tmp_path / "shared"
