"""bench/peers: studies of one subject (see bench/suite.yaml)."""
