"""What PolicyBERT knows of a Chatchat 0.3.1.3 root: its folders, its settings and its index files.

The arithmetic of SCORE_THRESHOLD is in :mod:`chatchat_policybert.stores.base`; running Chatchat
inside a root (its commands, the worker) is in :mod:`chatchat_policybert.chatchat.process`.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.settings import load_yaml
from chatchat_policybert.errors import InputError, SettingsError


def _settings(root: Path, name: str) -> dict[str, Any]:
    """A settings file of the root, parsed; no file: empty (Chatchat's defaults apply)."""
    path = Path(root) / name
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
    basic = _settings(root, "basic_settings.yaml")
    return {key: str((basic.get(key) or {}).get("host", "0.0.0.0")) for key in SERVERS}


def kb_root(root: Path) -> Path:
    """The folder of all knowledge bases: ``KB_ROOT_PATH`` of basic_settings.yaml, else Chatchat's default."""
    configured = _settings(root, "basic_settings.yaml").get("KB_ROOT_PATH")
    return Path(configured) if configured else Path(root) / "data" / "knowledge_base"


@dataclass(frozen=True)
class KbSettings:
    """What PolicyBERT reads of a root's kb_settings.yaml; a key the file leaves out has Chatchat 0.3.1.3's default."""

    default_kb: str = "samples"
    """DEFAULT_KNOWLEDGE_BASE (WeiMingPolicies after `chatchat-policybert setup`)."""
    vs_type: str = "faiss"
    """DEFAULT_VS_TYPE: the store `chatchat kb -r` fills and `search_docs` reads."""
    pg_uri: str | None = None
    """``kbs_config.pg.connection_uri`` (a SQLAlchemy URI)."""
    score_threshold: float = 2.0
    """SCORE_THRESHOLD (see :meth:`chatchat_policybert.stores.base.Store.cosine_cut`)."""
    chunk_size: int = 750
    """CHUNK_SIZE, in characters."""


def kb_settings(root: Path) -> KbSettings:
    """The root's kb_settings.yaml, read once; no file: Chatchat's defaults; a value of the wrong type: a
    :class:`SettingsError`."""
    path = Path(root) / "kb_settings.yaml"
    data = _settings(root, path.name)
    kbs_config = data.get("kbs_config") or {}
    defaults = KbSettings()

    def number(key: str, kind: type, default: float) -> Any:
        value = data.get(key, default)
        try:
            number = kind(value)
        except (TypeError, ValueError):
            raise SettingsError(f"{path}: {key} {value!r} is not a number") from None
        if not math.isfinite(number):  # YAML's .nan / .inf: every comparison with NaN is false
            raise SettingsError(f"{path}: {key} {value!r} is not a finite number")
        return number

    return KbSettings(
        default_kb=str(data.get("DEFAULT_KNOWLEDGE_BASE", defaults.default_kb)),
        vs_type=str(data.get("DEFAULT_VS_TYPE", defaults.vs_type)),
        pg_uri=(kbs_config.get("pg") or {}).get("connection_uri"),
        score_threshold=number("SCORE_THRESHOLD", float, defaults.score_threshold),
        chunk_size=number("CHUNK_SIZE", int, defaults.chunk_size),
    )


def default_kb(root: Path) -> str:
    """The root's DEFAULT_KNOWLEDGE_BASE; a root without kb_settings.yaml is an :class:`InputError`."""
    if not (Path(root) / "kb_settings.yaml").is_file():
        raise InputError(f"{root}: no kb_settings.yaml (not a Chatchat root; run `chatchat init`)")
    return kb_settings(root).default_kb


def vs_type(root: Path) -> str:
    """The root's DEFAULT_VS_TYPE: the store `chatchat kb -r` fills and `search_docs` reads."""
    return kb_settings(root).vs_type


def pg_uri(root: Path) -> str | None:
    """The root's ``kbs_config.pg.connection_uri`` (a SQLAlchemy URI), None if it sets none."""
    return kb_settings(root).pg_uri


def content_dir(root: Path, kb: str) -> Path:
    """Where a knowledge base's documents live (what `chatchat kb -r` reads)."""
    return kb_root(root) / kb / "content"


def vector_store_dir(root: Path, kb: str, embed_model: str) -> Path:
    """A knowledge base's FAISS folder for one embed model (Chatchat's `get_vs_path`)."""
    return kb_root(root) / kb / "vector_store" / embed_model.replace(":", "_")
