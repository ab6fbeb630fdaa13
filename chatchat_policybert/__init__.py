"""chatchat-policybert: the PolicyBERT embedding model for Langchain-Chatchat 0.3.x.

Kept import-free on purpose: the start-up hook (a ``.pth`` file) imports this package in every
Python process, so nothing heavy (torch, transformers) may load here. Import the submodules:
``chatchat_policybert.model.embeddings.PolicyBertEmbeddings``, ``chatchat_policybert.model.modeling_policybert`` ...
"""

__version__ = "0.1.0"
