"""The OpenAI-compatible HTTP front door (``--http-port`` on a router or a replica).

``schema`` parses and validates request bodies, ``format`` builds response bodies and stream
chunks, ``http`` is the aiohttp server that turns them into the process's own gRPC
``Generate`` calls over loopback, and ``doors`` is the small typed interface a server
implements to get one. Torch-free.
"""
