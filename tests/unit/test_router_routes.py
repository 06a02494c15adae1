"""The router's HTTP layer, in process through its real app: the admin token is one dependency on exactly the
control-plane routes and is checked before a body is parsed; every route family answers from the one state."""

from __future__ import annotations

from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from distserve.server.config import load_config
from distserve.server.router.app import ROUTE_FAMILIES, create_router_app
from distserve.server.router.auth import require_admin_token
from distserve.server.router.registry import WorkerRegistry
from distserve.server.router.state import RouterState

TOKEN = "s3cret"
ADMIN_ROUTES = {
    ("POST", "/register"),
    ("POST", "/heartbeat"),
    ("POST", "/deregister"),
    ("POST", "/drain"),
    ("GET", "/v1/workers"),
    ("GET", "/v1/admission"),
    ("POST", "/admin/fault"),
}


def _client(tmp_path) -> TestClient:
    cfg = load_config(overrides={"router": {"journal_path": str(tmp_path / "j.jsonl")}})
    state = RouterState(config=cfg, token=TOKEN, registry=WorkerRegistry(heartbeat_timeout_s=3.0))
    return TestClient(create_router_app(state))


def _routes() -> list[tuple[str, str, APIRoute]]:
    """Every route the app includes (FastAPI keeps included routers unflattened in ``app.routes``)."""
    return [
        (m, r.path, r)
        for family in ROUTE_FAMILIES
        for r in family.router.routes
        if isinstance(r, APIRoute)
        for m in r.methods
    ]


def _send(c: TestClient, method: str, path: str, headers: dict):
    if method == "GET":
        return c.get(path, headers=headers)
    # not JSON: a handler that parsed the body before the token check would answer 400
    return c.post(path, content=b"{not json", headers={"Content-Type": "application/json", **headers})


def test_the_token_dependency_guards_exactly_the_control_plane(tmp_path):
    with _client(tmp_path) as c:
        routes = _routes()
        guarded = {(m, p) for m, p, r in routes if any(d.call is require_admin_token for d in r.dependant.dependencies)}
        assert guarded == ADMIN_ROUTES
        assert {(m, p) for m, p, _ in routes} >= ADMIN_ROUTES | {("POST", "/v1/completions"), ("GET", "/health")}
        for method, path, _ in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {TOKEN}x"}):
                r = _send(c, method, path, headers)
                if (method, path) in ADMIN_ROUTES:
                    assert r.status_code == 401, (method, path, r.text)
                    assert r.json()["error"]["message"] == "missing or wrong bearer token"
                else:
                    assert r.status_code != 401, (method, path, r.text)


def test_with_the_token_the_body_is_read_and_its_faults_named(tmp_path):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with _client(tmp_path) as c:
        for path in ("/register", "/heartbeat", "/deregister", "/drain"):
            r = _send(c, "POST", path, auth)
            assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], (path, r.text)
        r = c.post("/drain", json={"worker_id": "nobody"}, headers=auth)
        assert r.status_code == 404 and "nobody" in r.json()["error"]["message"]
        listed = c.get("/v1/workers", headers=auth).json()
        assert listed["control_url"].startswith("http://127.0.0.1:")  # the control plane's own port
        assert {k: listed[k] for k in ("mode", "workers")} == {"mode": None, "workers": []}
        adm = c.get("/v1/admission", headers=auth).json()
        assert adm["inflight_requests"] == 0 and "max_inflight_requests" in adm["bounds"]


def test_open_route_families_answer_from_the_app_state(tmp_path):
    with _client(tmp_path) as c:
        state = c.app.state.router
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "down" and h.headers["retry-after"] == "1"
        assert "distserve_" in c.get("/metrics").text
        assert c.get("/sla/status").json()["breaker"]["state"] == "closed"
        assert "version" in c.get("/version").json()
        models = c.get("/v1/models").json()
        assert models["data"][0]["created"] == state.created
        # client.models.retrieve(id): the same card under the served name; another name is OpenAI's 404
        card = c.get(f"/v1/models/{models['data'][0]['id']}")
        assert card.status_code == 200 and card.json() == models["data"][0]
        missing = c.get("/v1/models/not-this-model")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        # no worker yet: the serving path and the tokenizer answer 503 with Retry-After, in OpenAI's shape
        for path, body in (
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/generate", {"prompt": "hi"}),
            ("/tokenize", {"prompt": "hi"}),
        ):
            r = c.post(path, json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", (path, r.text)
            assert r.json()["error"]["type"] == "service_unavailable"
        r = c.post("/v1/completions", json={"prompt": "hi", "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = c.post("/v1/completions", json={"prompt": "hi", "temperature": "hot"})
        assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
        assert c.get("/no/such/route").status_code == 404


def test_a_worker_leaving_is_logged_like_one_joining(tmp_path, caplog):
    """Before: the router logged 'worker X registered at URL' and nothing when X deregistered on its way out."""
    import logging

    from distserve.server.wire import CREDENTIAL_HEADER

    auth = {"Authorization": f"Bearer {TOKEN}"}
    reg = {"worker_id": "prefill-0", "role": "prefill", "url": "http://127.0.0.1:9", "pid": 4242,
           "fingerprint": {"architecture": "LlamaForCausalLM"}, "max_model_len": 2048}  # fmt: skip
    with _client(tmp_path) as c, caplog.at_level(logging.INFO, logger="distserve.server.router"):
        r = c.post("/register", json=reg, headers=auth)
        assert r.status_code == 200, r.text
        cred = {CREDENTIAL_HEADER: r.json()["credential"], **auth}
        r = c.post("/deregister", json={"worker_id": "prefill-0", "pid": 4242}, headers=cred)
        assert r.status_code == 200 and r.json() == {"deregistered": True}, r.text
    assert "worker prefill-0 (prefill, pid 4242) registered at http://127.0.0.1:9" in caplog.text
    assert "worker prefill-0 deregistered (it is leaving)" in caplog.text
