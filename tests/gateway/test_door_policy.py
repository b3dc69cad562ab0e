"""The door's access rules and the per-tenant trace store, as plain objects (real servers exercise
them in tests/e2e/test_access.py and test_slow_clients.py)."""

from __future__ import annotations

import pytest

from tokenline.gateway.door_policy import Access, DoorPolicy, resolve_metrics_auth
from tokenline.gateway.trace import RequestTrace, TraceStore


def test_with_keys_only_the_probes_are_open() -> None:
    policy = DoorPolicy(keys_configured=True, metrics_auth="admin")
    for path in ("/health", "/ping", "/live"):
        assert policy.access(path, 8000) is Access.OPEN, path
    for path in ("/version", "/tokenize", "/detokenize", "/v1/models", "/admin/usage", "/openapi.json", "/docs",
                 "/v1/requests/x/trace", "/anything-else"):
        assert policy.access(path, 8000) is Access.KEY, path
    assert policy.access("/metrics", 8000) is Access.ADMIN
    assert DoorPolicy(keys_configured=False).access("/tokenize", 8000) is Access.OPEN


@pytest.mark.parametrize(("mode", "access"), [("admin", Access.ADMIN), ("key", Access.KEY), ("none", Access.OPEN)])
def test_metrics_auth_modes(mode: str, access: Access) -> None:
    assert DoorPolicy(keys_configured=True, metrics_auth=mode).access("/metrics", 8000) is access


def test_a_metrics_listener_serves_only_metrics_and_the_api_listener_no_metrics() -> None:
    policy = DoorPolicy(keys_configured=True, metrics_auth="none", metrics_port=9100)
    assert policy.access("/metrics", 9100) is Access.OPEN
    assert policy.access("/metrics", 8000) is Access.ABSENT
    assert policy.access("/v1/models", 9100) is Access.ABSENT
    assert policy.access("/health", 9100) is Access.ABSENT
    assert policy.access("/v1/models", 8000) is Access.KEY


def test_default_metrics_auth_and_contradictions() -> None:
    assert resolve_metrics_auth(None, keys_configured=True, metrics_port=None) == "admin"
    assert resolve_metrics_auth(None, keys_configured=True, metrics_port=9100) == "none"
    assert resolve_metrics_auth(None, keys_configured=False, metrics_port=None) == "none"
    assert resolve_metrics_auth("key", keys_configured=True, metrics_port=9100) == "key"
    with pytest.raises(ValueError, match="needs --api-key or --keys"):
        resolve_metrics_auth("admin", keys_configured=False, metrics_port=None)


def test_only_requests_let_in_take_an_admitted_connection_and_never_probes() -> None:
    keyed = DoorPolicy(keys_configured=True)
    assert keyed.admits("/v1/models", authenticated=True)
    assert not keyed.admits("/dashboard", authenticated=False)  # open, but proves nothing
    open_server = DoorPolicy()
    assert open_server.admits("/v1/models", authenticated=False)
    for probe in ("/health", "/ready", "/ping", "/live"):
        assert not open_server.admits(probe, authenticated=False), probe


def _admitted(store: TraceStore, trace: RequestTrace) -> RequestTrace:
    store.add(trace)
    store.admit(trace)
    return trace


def test_traces_are_keyed_by_tenant_and_id() -> None:
    store = TraceStore(per_tenant=3)
    alice = _admitted(store, RequestTrace("same", tenant="alice"))
    bob = _admitted(store, RequestTrace("same", tenant="bob"))
    assert store.get("alice", "same") is alice and store.get("bob", "same") is bob
    assert store.get("carol", "same") is None
    assert store.newest_with_id("same") is bob
    for i in range(3):
        _admitted(store, RequestTrace(f"r{i}", tenant="alice"))
    assert store.get("alice", "same") is None and store.get("alice", "r2") is not None  # oldest evicted
    assert store.get("bob", "same") is bob  # alice's traffic evicts only alice's traces


def test_refused_requests_evict_only_the_same_tenants_refusals() -> None:
    store = TraceStore(per_tenant=20)  # refusals: a ring of 2 per tenant
    alice = _admitted(store, RequestTrace("a-1", tenant="alice"))
    mallory = _admitted(store, RequestTrace("m-1", tenant="mallory"))
    refused = RequestTrace("a-refused", tenant="alice")
    store.add(refused)  # never admitted (a 404, a 429)
    for i in range(100):
        store.add(RequestTrace(f"m-404-{i}", tenant="mallory"))
    assert store.get("alice", "a-1") is alice and store.get("alice", "a-refused") is refused
    assert store.get("mallory", "m-1") is mallory
    assert store.get("mallory", "m-404-99") is not None and store.get("mallory", "m-404-97") is None
    # An id used again: the newest request with it is shown, refused or not.
    again = RequestTrace("a-1", tenant="alice")
    store.add(again)
    assert store.get("alice", "a-1") is again and store.newest_with_id("a-1") is again
