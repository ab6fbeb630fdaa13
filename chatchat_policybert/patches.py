"""The mark on every Chatchat function the plugin replaces.

The hook, the transactional ``kb -r`` and the cached ensemble each replace a Chatchat function
with a wrapper carrying this attribute, and leave a function that has it alone: a module
imported twice, or a patch applied twice, never wraps the wrapper.
"""

WRAPPED_MARK = "__policybert_wrapped__"
