"""bench/lib: studies of one subject (see bench/suite.yaml)."""
