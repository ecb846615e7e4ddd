"""autotune: find the fastest way to train an LLM inside a memory budget, by measurement."""

__version__ = "0.1.0"
