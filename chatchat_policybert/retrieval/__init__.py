"""The lexical half and its fusion with the dense half: the BM25 analyzers, the saved BM25 index, the hybrid
settings (weights, analyzer) and the patched ensemble retriever both stores serve."""
