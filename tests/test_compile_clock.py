"""runtime.compile_clock: the seconds spent making programs, from JAX's monitoring events."""

import jax
import jax.numpy as jnp

from resconv_jax.runtime import compile_clock


def test_making_a_program_counts_and_running_it_again_does_not():
    start = compile_clock.seconds()
    program = jax.jit(lambda x: jnp.sin(x) * 2 + 1)  # a new function: traced, lowered, compiled
    x = jnp.ones(3)
    program(x).block_until_ready()
    made = compile_clock.seconds()
    assert made > start
    program(x).block_until_ready()  # from JAX's in-memory cache: nothing made
    assert compile_clock.seconds() == made
