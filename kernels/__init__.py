"""Attention kernels: one file per op holding the Pallas kernel, its wrapper, jitted API and pure-JAX reference."""
