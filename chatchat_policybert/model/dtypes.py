"""The compute dtypes, named once for the embeddings, the settings file, the CLIs and training.

Kept free of torch so that the settings check at Chatchat start-up stays light; the torch dtype
of a name is ``getattr(torch, name)``. ``auto`` picks bfloat16 only where the hardware multiplies
it natively (:func:`chatchat_policybert.model.embeddings.auto_dtype`).
"""

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = (*DTYPE_NAMES, "auto")
