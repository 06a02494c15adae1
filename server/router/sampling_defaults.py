"""Server-side sampling defaults: ``router.sampling_strategy`` and ``router.top_p`` (once ``decode.*``).

A request that leaves a sampling field out gets the configured default instead of
OpenAI's: with ``sampling_strategy: greedy`` an omitted ``temperature`` means 0
(greedy); with ``top_p`` an omitted ``top_p`` means ``router.top_p`` (and an
omitted ``temperature`` OpenAI's 1.0). A field the request gives always wins.
"""

from __future__ import annotations

from distserve.server.config import RouterConfig


def default_sampling(req, router: RouterConfig) -> tuple[float, float]:
    """(temperature, top_p) for ``req`` (a parsed protocol request) under the server's defaults."""
    given = req.model_fields_set
    if router.sampling_strategy == "greedy":
        temperature = req.temperature if "temperature" in given else 0.0
        top_p = req.top_p if "top_p" in given else 1.0
    else:
        temperature = req.temperature if "temperature" in given else 1.0
        top_p = req.top_p if "top_p" in given else router.top_p
    return temperature, top_p
