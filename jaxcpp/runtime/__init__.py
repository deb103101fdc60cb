"""Device side (jax): a stage, its programs and sampler, the in-process executor, a stage's own process."""
