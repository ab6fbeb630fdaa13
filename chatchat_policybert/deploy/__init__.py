"""Putting a model into a root and taking it out again: ``tune``'s runner and steps, hybrid calibration, rollback.

- :mod:`.tune` runs ``chatchat-policybert tune`` (the training it needs comes through an entry point);
  :mod:`.run` is its run folder (state, step timer, input keys, the lock).
- :mod:`.query_tune` holds its steps: the questions, the fold towers, :mod:`.crossfit`'s gate against
  :mod:`.gate`'s "before" (:mod:`.calibration` chooses the weights), the install and the report.
- :mod:`.rollback` restores what an install replaced: the two must agree byte for byte, so both live here.
"""
