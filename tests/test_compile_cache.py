"""The commands' persistent compilation cache: where it is, and how to move it or turn it off."""

import os

import pytest

from resconv_jax.runtime import compile_cache


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in (compile_cache.ENV, "JAX_COMPILATION_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path


def test_the_default_is_under_the_users_cache_folder(clean_env):
    assert compile_cache.folder() == os.path.join(str(clean_env / "xdg"), "resconv_jax", "jax")


def test_the_flag_wins_over_the_variables(clean_env, monkeypatch):
    monkeypatch.setenv(compile_cache.ENV, str(clean_env / "from_env"))
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(clean_env / "jax_env"))
    assert compile_cache.folder(str(clean_env / "flag")) == str(clean_env / "flag")
    assert compile_cache.folder() == str(clean_env / "from_env")
    monkeypatch.delenv(compile_cache.ENV)
    assert compile_cache.folder() == str(clean_env / "jax_env")


def test_off_turns_it_off(clean_env, monkeypatch):
    assert compile_cache.folder("off") is None
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.folder() is None
    assert compile_cache.folder(str(clean_env / "flag")) == str(clean_env / "flag")


def test_a_cache_path_that_is_not_a_folder_is_one_warning_and_no_cache(
    clean_env, monkeypatch, capsys
):
    """JAX printed a 2-line UserWarning and went on without the cache; now one line says so."""
    settings = {}
    monkeypatch.setattr(compile_cache.jax.config, "update", settings.__setitem__)
    (clean_env / "file").write_text("")
    assert compile_cache.enable(str(clean_env / "file")) is None
    assert settings == {"jax_enable_compilation_cache": False}
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("warning: the compilation cache ")
        and "without" in err[0]
    )
