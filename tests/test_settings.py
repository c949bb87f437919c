"""Flags and same-named environment variables for the server configs."""

from __future__ import annotations

import pytest

from replica.server.config import build_parser as replica_parser
from replica.server.config import parse_config as replica_config
from router.config import build_parser as router_parser
from router.config import parse_config as router_config


def test_environment_sets_defaults_and_flags_win(monkeypatch):
    monkeypatch.setenv("PREFIXMESH_PORT", "6001")
    monkeypatch.setenv("PREFIXMESH_PREFIX_CACHING", "false")
    assert replica_config([]).port == 6001
    assert replica_config(["--port", "6002"]).port == 6002
    assert replica_config([]).prefix_caching is False
    assert replica_config(["--prefix-caching"]).prefix_caching is True
    assert "(default: 6001)" in replica_parser().format_help()


def test_api_key_comes_from_the_environment_but_never_shows(monkeypatch):
    monkeypatch.setenv("PREFIXMESH_API_KEY", "sekrit-value")
    assert router_config([]).api_key == "sekrit-value"
    assert router_config(["--api-key", "other"]).api_key == "other"
    assert "sekrit-value" not in router_parser().format_help()
    monkeypatch.delenv("PREFIXMESH_API_KEY")
    assert router_config([]).api_key == ""


def test_replica_and_router_to_replica_keys_from_the_environment(monkeypatch):
    monkeypatch.setenv("PREFIXMESH_API_KEY", "cluster-key")
    replica = replica_config([])
    assert replica.api_key == "cluster-key" and "cluster-key" not in repr(replica)
    assert "cluster-key" not in replica_parser().format_help()
    router = router_config([])
    assert router.resolved_replica_api_key() == "cluster-key"  # one key covers both hops
    monkeypatch.setenv("PREFIXMESH_REPLICA_API_KEY", "replica-key")
    router = router_config([])
    assert (router.api_key, router.resolved_replica_api_key()) == ("cluster-key", "replica-key")
    assert router_config(["--replica-api-key", "flag"]).resolved_replica_api_key() == "flag"
    assert "replica-key" not in router_parser().format_help()
    assert "cluster-key" not in repr(router) and "replica-key" not in repr(router)


def test_bad_environment_value_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("PREFIXMESH_MAX_QUEUE", "lots")
    with pytest.raises(SystemExit):
        replica_parser()
    assert "PREFIXMESH_MAX_QUEUE" in capsys.readouterr().err
