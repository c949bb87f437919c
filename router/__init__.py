"""The KV-cache-aware gRPC router (torch-free): ``prefixmesh router --help``.

Modules: ``config`` (flags/env), ``discovery`` (replica view from Redis leases), ``index``
(the Lua prefix lookup and router-owned Redis keys), ``fastredis`` (the lookup's pipelined
connection), ``prompt`` (token ids and block hashes), ``policy`` (routing policies),
``routing`` (lookup and decide), ``forward`` (streaming with retry and failover), ``metrics``
(Prometheus + Cluster statistics), ``server`` (gRPC servicers, ``main``), ``bench`` (router
overhead benchmark), ``echo_replica`` (the one model-free echo server: a replica for the
router's tests and benchmark, and the load tester's stand-alone target).
"""
