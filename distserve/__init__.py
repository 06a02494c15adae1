"""The one import name distserve installs.

The project's packages are top-level folders of the checkout (``server/``, ``distbench/``, ``chaos/``,
``sla/``, ``reports/``, ``configs/``, ``ci/``, ``planner/``); this folder holds a relative symlink to each,
so the wheel installs them as ``distserve.server``, ``distserve.distbench``, ... and a user's environment
gains no generic top-level name. Code names them ``distserve.server.x`` (``make lint`` runs
``ci/namespace_rewrite.py --check``); docs/ARCHITECTURE.md, "Packaging", says why this shape.
"""
