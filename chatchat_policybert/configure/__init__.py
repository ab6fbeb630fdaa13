"""A root made ready for PolicyBERT, and checked: ``setup``'s merge (:mod:`.setup`) and ``doctor``'s checks
(:mod:`.doctor`), as functions.

Why a sub-package below ``evaluation`` and ``deploy``: the evaluation's root, ``tune``'s candidate and the
demo set a root up as ``chatchat-policybert setup`` does; calling the function keeps their dependency
visible to import-linter and their errors the caller's own (the command line only parses flags and
prints, :mod:`chatchat_policybert.cli`).
"""
