"""PolicyBERT itself: configuration, modeling, tokenization (characters + lexicon words), loading and the
LangChain embeddings class. Knows nothing of Chatchat; a new fusion is a change to ``modeling_policybert.py``."""
