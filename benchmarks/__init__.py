"""Benchmarks (see RESULTS.md). Importing the package sets glibc's malloc as `resconv_jax.main`
does (`host_memory.keep_freed_memory`, before jax is imported), so that each benchmark times the
steps a user's run takes; RESCONV_JAX_HOST_MALLOC=default times glibc's defaults."""

from resconv_jax.runtime import host_memory

host_memory.keep_freed_memory()
