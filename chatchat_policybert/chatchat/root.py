"""What PolicyBERT knows of a Chatchat 0.3.1.3 root: its folders, the servers' addresses and its index files.

The two settings files PolicyBERT reads and writes (model_settings.yaml, kb_settings.yaml) are
:mod:`chatchat_policybert.chatchat.config`'s.

The arithmetic of SCORE_THRESHOLD is in :mod:`chatchat_policybert.stores.base`; running Chatchat
inside a root (its commands, the worker) is in :mod:`chatchat_policybert.chatchat.process`.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.settings import load_yaml

BASIC_SETTINGS = "basic_settings.yaml"
"""Chatchat's own settings of the servers and folders (``setup --bind`` sets its hosts)."""


def _basic_settings(root: Path) -> dict[str, Any]:
    """The root's basic_settings.yaml, parsed; no file: empty (Chatchat's defaults apply)."""
    path = Path(root) / BASIC_SETTINGS
    return load_yaml(path) if path.is_file() else {}


SERVERS = ("API_SERVER", "WEBUI_SERVER")
"""The keys of basic_settings.yaml whose ``host`` Chatchat's API and WebUI bind (``chatchat init``: 0.0.0.0)."""


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server on this machine (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def server_hosts(root: Path) -> dict[str, str]:
    """``host`` of each of :data:`SERVERS` in basic_settings.yaml (missing: Chatchat's default, 0.0.0.0 off Windows)."""
    basic = _basic_settings(root)
    return {key: str((basic.get(key) or {}).get("host", "0.0.0.0")) for key in SERVERS}


def kb_root(root: Path) -> Path:
    """The folder of all knowledge bases: ``KB_ROOT_PATH`` of basic_settings.yaml, else Chatchat's default."""
    configured = _basic_settings(root).get("KB_ROOT_PATH")
    return Path(configured) if configured else Path(root) / "data" / "knowledge_base"


def content_dir(root: Path, kb: str) -> Path:
    """Where a knowledge base's documents live (what `chatchat kb -r` reads)."""
    return kb_root(root) / kb / "content"


def vector_store_dir(root: Path, kb: str, embed_model: str) -> Path:
    """A knowledge base's FAISS folder for one embed model (Chatchat's `get_vs_path`)."""
    return kb_root(root) / kb / "vector_store" / embed_model.replace(":", "_")
