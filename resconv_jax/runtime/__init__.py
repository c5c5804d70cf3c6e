"""What keeps a run alive and its record whole: the workdir (lock, atomic files), checkpoints,
metrics, signals, multi-process start, memory checks, divergence, and whether a run is finished.

Imports only `resconv_jax.errors` from the package, and each other."""
