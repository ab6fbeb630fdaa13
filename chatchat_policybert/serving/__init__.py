"""``chatchat-policybert serve``'s OpenAI-compatible ``/v1/embeddings`` server, by job.

- :mod:`.limits`: :class:`~.limits.ServerLimits`, the bounds, each also a ``serve`` flag;
- :mod:`.protocol`: uvicorn's h11 protocol with a deadline on headers and JSON for malformed HTTP;
- :mod:`.request`: one request's checks, from its bytes to the texts (and the error answer);
- :mod:`.batcher`: the fair batcher, concurrent requests through the model in turns;
- :mod:`.app`: the FastAPI app that ties them together.
"""
