"""bench/loadgen: studies of one subject (see bench/suite.yaml)."""
