"""Dynamic chunked pipeline parallel, host side: latency model, calibration, planners, simulator (no jax)."""
