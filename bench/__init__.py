"""The benchmark suite: studies by subject, registered in bench/suite.yaml, run by ``python -m bench``."""
