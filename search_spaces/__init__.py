"""Packaged YAML search spaces (``default.yaml``); loaded with importlib.resources."""
