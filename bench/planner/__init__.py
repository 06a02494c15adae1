"""bench/planner: studies of one subject (see bench/suite.yaml)."""
