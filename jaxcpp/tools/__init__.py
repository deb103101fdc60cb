"""Tooling the engine never imports: the pipeline simulator, plots, the chunk-plan command (host only)."""
