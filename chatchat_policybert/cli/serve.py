"""``chatchat-policybert serve``: the configured model as an OpenAI-compatible ``/v1/embeddings``."""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.config import served_platform
from chatchat_policybert.cli.common import add_root_argument
from chatchat_policybert.errors import InputError
from chatchat_policybert.serving.limits import ServerLimits

API_KEY_ENV = "POLICYBERT_API_KEY"
"""Where ``serve`` takes the API key from when ``--api-key`` is not given (keeps it out of the process list)."""


def register(commands: Any) -> None:
    """Add ``serve`` and its flags to the subcommands of the main parser."""
    serve = commands.add_parser("serve", help="serve the model as an OpenAI-compatible /v1/embeddings")
    add_root_argument(serve)
    serve.add_argument("--model-name", help="embed model name to serve (default: DEFAULT_EMBEDDING_MODEL of the root)")
    serve.add_argument("--model-path", type=Path, help="serve this model directory instead of the root's settings")
    serve.add_argument("--device", help="torch device with --model-path (default cpu)")
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: loopback only; set an API key before using another)",
    )
    serve.add_argument("--port", type=int, default=9998, help="port to listen on (default 9998)")
    ServerLimits.add_arguments(serve)
    serve.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' (default: $POLICYBERT_API_KEY, "
        "which keeps the key out of the process list)",
    )
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Serve the configured model as an OpenAI-compatible /v1/embeddings (see docs/deployment.md)."""
    import uvicorn

    from chatchat_policybert.chatchat.registry import load_embeddings
    from chatchat_policybert.chatchat.root import is_loopback
    from chatchat_policybert.chatchat.settings import LocalEmbeddingsConfig
    from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer
    from chatchat_policybert.serving.app import serving_app
    from chatchat_policybert.serving.limits import SHUTDOWN_GRACE_S
    from chatchat_policybert.serving.protocol import header_timeout_protocol

    # Every flag is checked before the model loads: a typo costs no loading time, and a port another process holds
    # or a host that is no address of this machine is refused before loading, not after "serving … at".
    if not 0 < args.port <= 65535:
        raise InputError(f"--port {args.port}: expected a TCP port, 1..65535")
    limits = ServerLimits.from_arguments(args)
    if args.model_path is not None and not args.model_path.is_dir():
        raise InputError(f"--model-path {args.model_path}: not a directory; expected a PolicyBERT model directory")
    listening = bound_socket(args.host, args.port)
    if args.model_path is not None:
        config = LocalEmbeddingsConfig(model_path=str(args.model_path.resolve()), device=args.device or "cpu")
        platform, name = "command line", args.model_name or "policybert"
    else:
        local = served_platform(args.root, args.model_name)
        config, platform = local.config, local.platform_name
        name = args.model_name or local.embed_models[0]
    try:
        embeddings = load_embeddings(config, args.root, platform)
    except RuntimeError as exc:  # load_embeddings wraps the loader's one-line ModelDirError
        if isinstance(exc.__cause__, InputError):
            raise InputError(str(exc.__cause__)) from None
        raise
    except (FileNotFoundError, ImportError, TypeError) as exc:  # a settings key to fix, named by load_embeddings
        raise InputError(str(exc)) from None
    tokenizer = getattr(embeddings, "tokenizer", None)
    if not isinstance(tokenizer, PolicyBertTokenizer):
        raise InputError(
            f"serve needs PolicyBertEmbeddings (its tokenizer counts tokens); {platform} configures "
            f"{type(embeddings).__name__}"
        )
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None and not is_loopback(args.host):
        print(
            f"WARNING: serving on {args.host}, reachable from other machines, WITHOUT an API key: anyone who can "
            f"reach this port can use the model; set {API_KEY_ENV} (or --api-key) or bind 127.0.0.1",
            file=sys.stderr,
            flush=True,
        )
    dimension = len(embeddings.embed_documents(["维度"])[0])
    app = serving_app(embeddings, name, limits, api_key)
    print(
        f"serving '{name}' (dimension {dimension}) at http://{args.host}:{args.port}/v1/embeddings"
        f"{' (API key required)' if api_key else ''}",
        flush=True,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_keep_alive=5,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        http=header_timeout_protocol(limits),
    )
    server = uvicorn.Server(config)
    server.run(sockets=[listening])
    return 0 if server.started else 3  # 3: uvicorn's own code for a server that did not start


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (not yet listening: uvicorn listens once the model is loaded), or an
    :class:`InputError` naming the flag: ``--host`` that is no address or host name (``999.1.1.1``), an address
    this machine does not have, a port in use. uvicorn serves on this very socket, so nothing can take the port
    between the check and the serving."""
    from chatchat_policybert.chatchat.root import check_bind_host

    expected = "expected an IP address of this machine (127.0.0.1, ::1, 0.0.0.0) or a host name"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn picks it: `localhost` is 127.0.0.1
    try:
        check_bind_host(host)
        family, kind, proto, _, address = socket.getaddrinfo(host, port, family=family, type=socket.SOCK_STREAM)[0]
    except (InputError, socket.gaierror, UnicodeError):
        raise InputError(f"--host {host!r}: {expected}") from None
    listening = socket.socket(family, kind, proto)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a just-closed server's port is free
    try:
        listening.bind(address)
    except OSError as exc:
        listening.close()
        hint = "another process listens there; choose another --port" if exc.errno == errno.EADDRINUSE else expected
        raise InputError(f"--host {host} --port {port}: cannot listen there ({exc.strerror}): {hint}") from None
    return listening
