"""Flax Llama-family models, their configs and checkpoint I/O (jaxcpp.models)."""
