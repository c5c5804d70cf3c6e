"""JAX's persistent compilation cache for the commands (`main`, `reproduce`): a rerun or a resume
loads the programs compiled before instead of compiling them again.

Where: `--compilation_cache=DIR`, else $RESCONV_JAX_COMPILATION_CACHE, else JAX's own
$JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/resconv_jax/jax (~/.cache/resconv_jax/jax);
`off` (in the flag or the variable) turns it off. Bounded at MAX_BYTES (JAX evicts the least
recently used entries beyond it).
"""

from __future__ import annotations

import os
import sys

import jax

ENV = "RESCONV_JAX_COMPILATION_CACHE"
MAX_BYTES = 2 << 30
MIN_COMPILE_SECONDS = 0.2  # smaller programs compile faster than they load


def folder(setting: str = "") -> str | None:
    """The cache folder for the flag's `setting` ("" when not given), or None when off."""
    for value in (
        setting,
        *(os.environ.get(name, "") for name in (ENV, "JAX_COMPILATION_CACHE_DIR")),
    ):
        if value:
            return None if value == "off" else os.path.expanduser(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "resconv_jax", "jax")


def enable(setting: str = "") -> str | None:
    """Turns the cache on at `folder(setting)`; returns the folder, or None when it is off.

    When the folder is JAX's own $JAX_COMPILATION_CACHE_DIR, JAX's settings are left as they are
    (a cache that another program configured, e.g. a test session's)."""
    where = folder(setting)
    if where is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if not setting and not os.environ.get(ENV) and os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return where
    try:
        os.makedirs(where, exist_ok=True)
    except OSError as error:  # the cache only saves time: say so and compile without it
        print(
            f"warning: the compilation cache {where} is not a folder that can be made "
            f"({error.strerror or type(error).__name__}); compiling without the cache",
            file=sys.stderr,
            flush=True,
        )
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return where
