"""bench/serving: studies of one subject (see bench/suite.yaml)."""
