"""``--sampling``: what a run's requests ask of the sampler.

- ``openai-default`` (the default): no ``temperature``, no ``top_p``: what the OpenAI SDK sends when the
  caller sets neither, so the server's own defaults apply (distserve: ``router.sampling_strategy``);
- ``greedy``: ``temperature: 0``;
- ``T,top_p[,top_k]``: those three, e.g. ``0.7,0.95`` or ``1,1,50``.

The name is recorded in the result (``sampling``, and ``config.sampling``), so every figure says how
its tokens were chosen.
"""

from __future__ import annotations

DEFAULT = "openai-default"


def sampling_fields(spec: str) -> dict:
    """The request-body fields for ``spec``; ValueError naming the flag when it does not parse."""
    if spec == DEFAULT:
        return {}
    if spec == "greedy":
        return {"temperature": 0.0}
    parts = spec.split(",")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        temperature, top_p = float(parts[0]), float(parts[1])
        top_k = int(parts[2]) if len(parts) == 3 else None
    except ValueError:
        raise ValueError(
            f"--sampling must be greedy, openai-default or T,top_p[,top_k] (e.g. 0.7,0.95), got {spec!r}"
        ) from None
    if not 0.0 <= temperature <= 2.0 or not 0.0 < top_p <= 1.0 or (top_k is not None and top_k < -1):
        raise ValueError(f"--sampling {spec!r}: needs 0 <= T <= 2, 0 < top_p <= 1 and top_k >= -1")
    fields: dict = {"temperature": temperature, "top_p": top_p}
    if top_k is not None:
        fields["top_k"] = top_k
    return fields
