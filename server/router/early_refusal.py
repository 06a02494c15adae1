"""The cheap 429: a data-plane request that admission would refuse whatever its prompt is refused before the
app routes it, reads its body, parses or tokenizes it.

Under 2 000 closed-loop streaming clients most requests are 429s (5 686 of 6 850 in the first run), and each
went the whole way: routing, the JSON body, the OpenAI model's validation, the prompt's tokens, then
``Admission.decide`` said no. Their retries come back in waves (Retry-After 1-7 s), and a wave of a few hundred
such requests kept the router's event loop 1.5-1.8 s behind: everything else served there waited as long
(``/health``, the workers' heartbeats before the control plane had its own thread).

Every bound and SLO check of ``Admission.decide`` refuses a longer prompt whenever it refuses a shorter one
(queued counts, queued tokens + the prompt's, a predicted TTFT that grows with the prompt; the cases without a
prediction do not depend on it). So when ``decide`` refuses a one-token prompt with ``shed``, it refuses this
request too, and ``EarlyRefusal`` answers it at once, in the same shape (429, ``rate_limit_exceeded``,
``Retry-After``, ``x-distserve-admission``), counted and journaled as admission's other sheds (the journal's
``prompt_tokens`` is null: the body was not read). It stands aside — the request goes the normal way — when a
backup pool is configured (a refusal may go there), when no worker pair is healthy (503 says so), or when the
request's SLO headers do not parse (its 400 names the header). A request that would have been refused for
something else (a 400 naming a field) gets the 429 instead while the server is overloaded: its retry learns
the rest.
"""

from __future__ import annotations

from starlette.datastructures import Headers

from distserve.server.router.admission import InvalidSlo, parse_slo
from distserve.server.router.serving import shed
from distserve.server.router.state import RouterState

DATA_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate"})


class EarlyRefusal:
    def __init__(self, app, state: RouterState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in DATA_PATHS or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        st = self.state
        adm = st.admission
        if adm is None or (st.backup is not None and st.backup.configured) or st.registry.mode() is None:
            return await self.app(scope, receive, send)
        ac = st.config.router.admission
        try:
            slo = parse_slo(Headers(scope=scope), ac.slo_ttft_ms, ac.slo_tpot_ms, ac.on_slo_miss)
        except InvalidSlo:
            return await self.app(scope, receive, send)
        d = adm.decide(1, slo, protect=False)  # the overtaking guard refuses short prompts, not long ones
        if d.route != "shed":
            return await self.app(scope, receive, send)
        await shed(st, d, None)(scope, receive, send)  # the normal path's 429, as a Starlette response
