"""The GPU check: what the platform measures on a GPU, in one call (docs/gpu.md)."""
