"""Putting a model into a root and taking it out again: ``tune``'s runner and steps, hybrid calibration, rollback.

- :mod:`.tune` runs ``chatchat-policybert tune`` (the training it needs comes through an entry point);
  :mod:`.run` is its run folder (state, step timer, input keys).
- :mod:`.candidate` builds and calibrates the candidate root (:mod:`.calibration` chooses the weights),
  :mod:`.gate` decides, :mod:`.install` installs, :mod:`.report` says what was decided and why.
- :mod:`.rollback` restores what install replaced: the two must agree byte for byte, so both live here.
"""
