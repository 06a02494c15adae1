"""bench/kernels: studies of one subject (see bench/suite.yaml)."""
