"""resconv_jax: full-batch gradient descent on residual Transformers (arXiv 2506.05249)."""
