"""TLS and mutual TLS for gRPC and HTTP, servers and clients. Torch-free.

Servers (replica, router) take ``--tls-cert`` and ``--tls-key`` (PEM files): their gRPC port
and their OpenAI HTTP port then speak TLS only, so a plaintext client is refused.
``--tls-client-ca`` additionally requires every client to present a certificate signed by that
CA (mutual TLS): set it on replicas so that only routers holding such a certificate reach them.

Clients take ``--tls-ca`` (the CA that signed the server's certificate; with it the channel is
TLS) and, for mutual TLS, ``--tls-cert`` / ``--tls-key`` of their own. The router's channels to
the replicas use its ``--tls-ca`` and present its own ``--tls-cert`` / ``--tls-key``; a server's
HTTP front door reaches its own gRPC port the same way. Certificates must name the address
clients dial (``127.0.0.1``, a host name, a Kubernetes service name) in their SAN.
"""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

HELP: dict[str, str] = {
    "tls_cert": "PEM certificate: serve gRPC and HTTP over TLS only (with --tls-key); also "
    "the client certificate this process presents to the servers it calls",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA bundle: require clients to present a certificate it signed "
    "(mutual TLS); needs --tls-cert",
    "tls_ca": "PEM CA bundle that signed the certificates of the servers this process calls "
    "(routers: the replicas; every server: its own HTTP door to its gRPC port); empty = "
    "plaintext calls",
}


def _read(path: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise SystemExit(f"cannot read TLS file {path}: {exc.strerror}") from exc


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The TLS file paths of one process (empty strings: off)."""

    cert: str = ""
    key: str = ""
    client_ca: str = ""
    ca: str = ""

    @classmethod
    def from_config(cls, config: Any) -> TlsFiles:
        return cls(config.tls_cert, config.tls_key, config.tls_client_ca, config.tls_ca)

    @property
    def serving(self) -> bool:
        return bool(self.cert)

    def problems(self) -> list[str]:
        out = []
        if bool(self.cert) != bool(self.key):
            out.append("--tls-cert and --tls-key go together")
        if self.client_ca and not self.cert:
            out.append("--tls-client-ca needs --tls-cert and --tls-key")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key),
                           ("--tls-client-ca", self.client_ca), ("--tls-ca", self.ca)):  # fmt: skip
            if path and not Path(path).expanduser().is_file():
                out.append(f"{flag}: no such file {path}")
        return out

    # -- server side ----------------------------------------------------------------------

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind ``address``: TLS (mutual with ``client_ca``) when a cert is set, else plain."""
        if not self.serving:
            return server.add_insecure_port(address)
        creds = grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))],
            root_certificates=_read(self.client_ca) if self.client_ca else None,
            require_client_auth=bool(self.client_ca),
        )
        return server.add_secure_port(address, creds)

    def http_context(self) -> ssl.SSLContext | None:
        """The aiohttp server's SSL context (None: plain HTTP)."""
        if not self.serving:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        if self.client_ca:
            context.load_verify_locations(self.client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    # -- client side ----------------------------------------------------------------------

    def client_http_context(self) -> ssl.SSLContext | None:
        """An HTTPS client's SSL context: trusting ``ca`` (else the system's CAs), presenting
        ``cert`` to a server that wants client certificates; None with neither set."""
        if not self.ca and not self.cert:
            return None
        context = ssl.create_default_context(cafile=self.ca or None)
        if self.cert:
            context.load_cert_chain(self.cert, self.key or None)
        return context

    def loopback(self) -> TlsFiles:
        """How a server's HTTP door calls its own gRPC port: trusting ``ca`` (else the client
        CA, else its own certificate) and presenting its own certificate."""
        if not self.serving:
            return TlsFiles()
        return TlsFiles(self.cert, self.key, "", self.ca or self.client_ca or self.cert)


def channel_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials | None:
    """TLS credentials for a client channel (None without a CA: plaintext)."""
    if not ca:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca),
        private_key=_read(key) if cert and key else None,
        certificate_chain=_read(cert) if cert and key else None,
    )


def aio_channel(
    target: str, files: TlsFiles | None, options: list[tuple[str, Any]] | None = None
) -> grpc.aio.Channel:
    """An asyncio channel: TLS when ``files.ca`` is set (presenting ``files.cert``)."""
    creds = channel_credentials(files.ca, files.cert, files.key) if files else None
    if creds is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, creds, options=options)


def channel(
    target: str, files: TlsFiles | None, options: list[tuple[str, Any]] | None = None
) -> grpc.Channel:
    """A blocking channel, as ``aio_channel``."""
    creds = channel_credentials(files.ca, files.cert, files.key) if files else None
    if creds is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, creds, options=options)


# -- client commands (generate, top, loadtest) ----------------------------------------------


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """``--tls-ca`` (+ ``--tls-cert`` / ``--tls-key`` for mutual TLS), from the environment by
    default (``PREFIXMESH_TLS_CA``, ...), as the servers read theirs."""
    env = os.environ.get
    parser.add_argument(
        "--tls-ca", default=env("PREFIXMESH_TLS_CA", ""),
        help="PEM CA that signed the router's certificate: connect over TLS (empty = "
        "plaintext) [env PREFIXMESH_TLS_CA]",
    )  # fmt: skip
    parser.add_argument(
        "--tls-cert", default=env("PREFIXMESH_TLS_CERT", ""),
        help="PEM client certificate, for a router that requires mutual TLS "
        "[env PREFIXMESH_TLS_CERT]",
    )  # fmt: skip
    parser.add_argument(
        "--tls-key", default=env("PREFIXMESH_TLS_KEY", ""),
        help="PEM private key of --tls-cert [env PREFIXMESH_TLS_KEY]",
    )  # fmt: skip


def client_files(args: argparse.Namespace) -> TlsFiles:
    """The client flags of ``add_client_flags`` as ``TlsFiles`` (for ``channel``)."""
    return TlsFiles(
        getattr(args, "tls_cert", ""), getattr(args, "tls_key", ""), "",
        getattr(args, "tls_ca", ""),
    )  # fmt: skip
