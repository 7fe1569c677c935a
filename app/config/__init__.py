"""Configuration: the typed schema (schema.py), the YAML/CLI loader (load.py), checks against the target and cluster (checks.py)."""
