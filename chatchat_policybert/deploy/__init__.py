"""Putting a model into a root and taking it out again: hybrid calibration, and rollback. What install writes
and rollback restores must agree byte for byte, so both live here."""
