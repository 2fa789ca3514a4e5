"""``data._util.cache_dir``: the folder for derived files follows the XDG convention ($VLPE_CACHE_DIR, else
$XDG_CACHE_HOME/vlpe, else ~/.cache/vlpe) and is created, sub-folder included."""

from __future__ import annotations

from data._util import cache_dir


def test_the_cache_folder_follows_vlpe_cache_dir_then_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VLPE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir("points") == tmp_path / "home" / ".cache" / "vlpe" / "points"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "vlpe"
    monkeypatch.setenv("VLPE_CACHE_DIR", str(tmp_path / "own"))
    assert cache_dir("points") == tmp_path / "own" / "points"
    assert (tmp_path / "own" / "points").is_dir() and (tmp_path / "xdg" / "vlpe").is_dir()
