"""chatchat-policybert: the PolicyBERT embedding model for Langchain-Chatchat 0.3.x.

``from chatchat_policybert import PolicyBertEmbeddings`` is the name a deployment registers and
LangChain users import. It is resolved lazily (PEP 562): the start-up hook (a ``.pth`` file)
imports this package in every Python process, so importing it must stay light — torch and
transformers load only when the class is first asked for.

Importing it also sets ``GOMP_SPINCOUNT=10000`` where the user set no OpenMP wait policy
(:mod:`chatchat_policybert.cpu`): it must be in the environment before torch loads, and this import is the first thing
of the package every process runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from chatchat_policybert.cpu import share_cpu

share_cpu()

if TYPE_CHECKING:
    from chatchat_policybert.model.embeddings import PolicyBertEmbeddings

__version__ = "0.2.0"
"""The one place the version lives (setup.cfg reads it: `version = attr: …`)."""
__all__ = ["PolicyBertEmbeddings", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "PolicyBertEmbeddings":
        from chatchat_policybert.model.embeddings import PolicyBertEmbeddings

        return PolicyBertEmbeddings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
