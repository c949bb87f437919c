"""The KV-cache-aware gRPC router (torch-free): ``prefixmesh router --help``.

Modules: ``config`` (flags/env), ``discovery`` (replica view from Redis leases), ``index``
(the Lua prefix lookup and router-owned Redis keys), ``fastredis`` (the lookup's pipelined
connection), ``prompt`` (token ids and block hashes), ``policy`` (routing policies),
``routing`` (lookup and decide), ``forward`` (streaming with retry and failover), ``metrics``
(Prometheus + Cluster statistics) and ``server`` (gRPC servicers, ``main``). Its measuring
tools live with the load tester: ``loadtest/router_bench.py`` (the router overhead benchmark) and
``loadtest/echo_replica.py`` (the model-free echo server its tests and benchmark route to).
"""
