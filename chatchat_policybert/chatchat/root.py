"""What PolicyBERT knows of a Chatchat 0.3.1.3 root: its folders, the servers' addresses and its index files.

The two settings files PolicyBERT reads and writes (model_settings.yaml, kb_settings.yaml) are
:mod:`chatchat_policybert.chatchat.config`'s.

The arithmetic of SCORE_THRESHOLD is in :mod:`chatchat_policybert.stores.base`; running Chatchat
inside a root (its commands, the worker) is in :mod:`chatchat_policybert.chatchat.process`.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.settings import load_yaml
from chatchat_policybert.errors import InputError

BASIC_SETTINGS = "basic_settings.yaml"
"""Chatchat's own settings of the servers and folders (``setup --bind`` sets its hosts)."""


def _basic_settings(root: Path) -> dict[str, Any]:
    """The root's basic_settings.yaml, parsed; no file: empty (Chatchat's defaults apply)."""
    path = Path(root) / BASIC_SETTINGS
    return load_yaml(path) if path.is_file() else {}


SERVERS = ("API_SERVER", "WEBUI_SERVER")
"""The keys of basic_settings.yaml whose ``host`` Chatchat's API and WebUI bind (``chatchat init``: 0.0.0.0)."""


# A host name's label (RFC 1123): letters, digits and inner hyphens, 1-63 characters.
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def check_bind_host(host: str) -> str:
    """``host`` if it can be bound: an IP address (``ipaddress``) or a host name of RFC 1123 labels (253 characters at
    most, a trailing dot allowed); an :class:`InputError` naming ``--bind`` otherwise.

    Why checked: Chatchat writes whatever basic_settings.yaml says into uvicorn's and streamlit's command line, so a
    port in the host (``127.0.0.1:7861``), an address out of range (``256.1.1.1``), ``*`` or a newline fail only when
    Chatchat starts, far from the ``setup`` that wrote them.
    """
    if _address(host) is not None:
        return host
    name = host[:-1] if host.endswith(".") else host
    labels = name.split(".")
    numeric = bool(labels) and labels[-1].isdigit()  # 256.1.1.1 is a bad address, not a host name
    if not name or len(name) > 253 or numeric or not all(_LABEL.fullmatch(label) for label in labels):
        raise InputError(
            f"--bind {host!r}: expected an IP address (127.0.0.1, ::1, 0.0.0.0) or a host name (letters, digits, "
            f"hyphens, dots), without a port"
        )
    return host


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server on this machine: ``localhost`` (any case, a trailing dot allowed) or a
    loopback address (127.0.0.0/8 in any form ``ipaddress`` or the C library reads, e.g. ``127.1``; ``::1``).

    ``setup`` and ``doctor`` both ask this one function. ``127.1`` is the C library's short form of 127.0.0.1, which
    uvicorn binds; ``ipaddress`` does not read it, ``inet_aton`` does.
    """
    if host.lower().rstrip(".") == "localhost":
        return True
    address = _address(host)
    return address is not None and address.is_loopback  # a host name may resolve to any interface


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address: what ``ipaddress`` reads, or a dotted-decimal short form the C library's
    ``inet_aton`` reads (``127.1``); None for anything else."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if not re.fullmatch(r"[0-9]+(\.[0-9]+){0,3}", host):  # glibc's inet_aton accepts trailing text after a space
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


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


CAPTURE_SETTINGS = "policybert_capture.json"
"""Whether the API records its users' questions, and for how long they are kept (``setup --capture``; read by the
API at each question, by ``doctor`` and by ``feedback``): :mod:`chatchat_policybert.feedback.settings`."""
FEEDBACK_DIR = "policybert_feedback"
"""The plugin's own folder of captured questions and feedback (mode 0700), not Chatchat's ``info.db``, which ``kb
-r`` workers write and ``kb --clear-tables`` drops."""


def capture_settings_file(root: Path) -> Path:
    """The root's :data:`CAPTURE_SETTINGS` (absent: capture off, the default)."""
    return Path(root) / CAPTURE_SETTINGS


def feedback_db(root: Path) -> Path:
    """The SQLite file of captured questions, their hits and users' feedback (:mod:`chatchat_policybert.feedback`),
    in the root's :data:`FEEDBACK_DIR`."""
    return Path(root) / FEEDBACK_DIR / "feedback.sqlite3"


# A tune's run folder: ``deploy`` writes it, the feedback store's purge scrubs the captured questions out of it
TUNE_DIR = "policybert_tune"
"""In the root: every knowledge base's default tune run folder is ``ROOT/policybert_tune/KB``."""
GATE = "query_gate.json"
"""In a run folder: the gate's decision, with the tower record it installs (``tower_record``)."""
TOWER_RECORDS = "query_towers"
"""Folder of the run folder with a record per installed query tower (``<its directory's name>.json``): the documents
its questions name, each judged question's held-out record from the gate that installed it, and the stored vectors
it was judged against. A later tune's "before" for those questions; kept after a ``rollback``, which may serve an
earlier tower again."""
STEP_CACHES = "query"
"""Folder of the run folder with the steps' results, one folder per key of their inputs."""
BACKUP_DIR = "previous"
"""Folder of the run folder with the deployment an install replaced: what ``rollback`` restores."""
