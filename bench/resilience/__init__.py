"""bench/resilience: studies of one subject (see bench/suite.yaml)."""
