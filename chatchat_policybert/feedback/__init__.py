"""The deployment learns from its users (issue 49): their questions captured (opt-in), which source answered them.

- :mod:`.settings`: the root's capture switch and retention (``setup --capture on|off``), read by the API per question.
- :mod:`.redact`: what a question loses before it is stored (ID-card, phone, e-mail, bank-card numbers).
- :mod:`.store`: the plugin's own SQLite file (WAL, versioned, 0600): captures, their hits, feedback, labels; purge.
- :mod:`.pg_store`: the same tables in the plugin's schema of the database, where the knowledge bases are on pg
  (:func:`.store.open_store` picks the one of a root).
- :mod:`.http`: in Chatchat's API process, what is captured and when, the id it answers with, and
  ``POST /policybert/feedback``; :mod:`.fingerprint`: which model and settings served a question.
- :mod:`.export`: the marked questions as the JSONL ``tune --questions`` reads.
- The WebUI's control under each answer ("哪条出处回答了问题？") is :mod:`chatchat_policybert.plugin.webui`.

The command is ``chatchat-policybert feedback`` (:mod:`chatchat_policybert.cli.feedback`); the deployment guide's
"Users' questions and feedback" says what is kept, where, and for how long.
"""
