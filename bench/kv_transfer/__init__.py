"""bench/kv_transfer: studies of one subject (see bench/suite.yaml)."""
