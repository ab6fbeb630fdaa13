"""The environment switches that turn the plugin's patches off, and the mark every patch leaves.

The hook, the transactional ``kb -r``, the cached ensemble and pg's search each replace a Chatchat
function with a wrapper carrying :data:`WRAPPED_MARK`, and leave a function that has it alone: a
module imported twice, or a patch applied twice, never wraps the wrapper. Standard library only:
the start-up hook imports this in every interpreter.
"""

import os

WRAPPED_MARK = "__policybert_wrapped__"
DISABLE_ENV = "CHATCHAT_POLICYBERT_HOOK"
"""0/false/no/off: no patch at all (Chatchat as shipped)."""
BM25_CACHE_ENV = "CHATCHAT_POLICYBERT_BM25_CACHE"
"""0/false/no/off: Chatchat's own search on both stores (BM25 rebuilt per question on FAISS, dense-only on pg)."""
WARM_UP_ENV = "CHATCHAT_POLICYBERT_WARM_UP"
"""0/false/no/off: the API does not load the model and the default knowledge base at start."""
API_THREADS_ENV = "CHATCHAT_POLICYBERT_API_THREADS"
"""Torch threads of Chatchat's API process (a positive integer; unset: :data:`API_THREADS_DEFAULT`):
``plugin.warm_up.use_api_threads``."""
API_THREADS_DEFAULT = 1
"""One torch thread per question: a question's forward pass is hundreds of small operations, each an OpenMP region
whose threads wait for each other, so a second thread gains little for one question and, when the other cores are
busy (another request, a `kb -r`), made the question 22-29x slower (docs/speed.md). Chatchat's API process otherwise
starts torch with as many threads as cores."""


def switched_off(env: str) -> bool:
    """Whether the environment variable ``env`` says off (0/false/no/off); unset means on."""
    return os.environ.get(env, "1").strip().lower() in {"0", "false", "no", "off"}
