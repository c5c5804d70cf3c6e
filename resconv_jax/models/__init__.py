"""Models: the paper's residual Transformer."""
