"""Device side: KV cache arrays, step inputs, jitted stage programs, executors, sampler."""
