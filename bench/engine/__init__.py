"""bench/engine: studies of one subject (see bench/suite.yaml)."""
