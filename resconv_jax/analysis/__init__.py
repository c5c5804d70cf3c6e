"""What is measured on a model: the spectral probe, the tangent kernel and its certificate, rates
and per-run summaries."""
