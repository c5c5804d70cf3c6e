"""The parts of `python -m resconv_jax.reproduce` (the command itself: `resconv_jax.reproduce`).

`outcomes`: one experiment run, resumed, reused or replaced by its fallback; `workers`: several
at a time, each in a worker process (`--jobs`); `report`: REPORT.md and the README's claims table.
"""
