"""What keeps a run alive and its record whole: the workdir (lock, atomic files), checkpoints,
metrics, signals, multi-process start, memory checks, divergence, whether a run is finished,
and the host CPU the reports name.

Imports only `resconv_jax.errors` from the package, and each other."""
