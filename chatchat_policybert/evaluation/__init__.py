"""Retrieval evaluation of a deployment: ``chatchat-policybert eval``.

BM25, dense, RRF and Chatchat's own ensemble ranked over the chunks Chatchat's splitter makes,
scored against questions with evidence (:mod:`.dataset`, :mod:`.metrics`, :mod:`.retrievers`,
:mod:`.knowledge_base`, the command in :mod:`.evaluate`). A deployment tool, not training: it
measures whatever model directory a user serves.
"""
