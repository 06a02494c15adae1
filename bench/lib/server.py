"""The suite's server starter is the one the tests use: ``distbench.target.ServeProcess`` (``distserve serve``
in a subprocess on port 0, ``url`` and ``token`` once ready, stopped by PID). Studies import it from here so
that there is one way to start a deployment for a test, a drill or a study."""

from __future__ import annotations

from distserve.distbench.target import ServeProcess, deep_merge

__all__ = ["ServeProcess", "deep_merge"]
