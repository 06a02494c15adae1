"""Placement planner (DistServe's search): profile the engine, simulate prefill/decode queues for a
workload, and recommend a layout.

Modules: ``profile`` (the versioned profile file), ``latency`` (step-time models fitted to a profile),
``workload`` (request lengths), ``slo`` (SLOs and attainment), ``simulator`` (the discrete-event model of
router + workers), ``layouts`` (what can be deployed on N devices), ``search`` (goodput per layout),
``deploy`` (the ``distserve serve`` command of a layout), ``profiler`` (measuring a profile through the real
engine), ``validate`` (measured attainment of a layout on real servers), ``cli`` (``distserve profile`` and
``distserve plan``). Shipped profiles: ``profiles/NAME.json`` (``distserve plan --profile NAME``), each built
by a bench study from recorded runs (the H200: ``bench/planner/h200_profile.py``).
"""
