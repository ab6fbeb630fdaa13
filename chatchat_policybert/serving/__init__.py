"""``chatchat-policybert serve``: an OpenAI-compatible ``/v1/embeddings`` server for PolicyBERT directories."""
