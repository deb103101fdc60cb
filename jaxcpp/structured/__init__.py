"""Structured outputs: constraints (`constraint`), the grammar library behind one interface (`grammar`),
and a constrained request's state and step bitmask in the engine (`request`). Host side, no jax."""
