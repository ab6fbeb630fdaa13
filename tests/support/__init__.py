"""Helpers the tests and the benchmarks share; never imported by the runtime (``tests/core/test_layout.py``).

- :mod:`tests.support.tiny_models`: download-free tiny model directories (random, seeded weights).
- :mod:`tests.support.pg_cluster`: a throw-away PostgreSQL + pgvector server on loopback.
- :mod:`tests.support.fast_loop`: what makes a test `slow` (the fast loop's ``slow_fixture`` and its guard).

They are imported as ``tests.support.*`` with the repository root on ``sys.path``: pytest puts it
there (``pythonpath = .`` in ``setup.cfg``), and ``bench/`` scripts, which run from a checkout as
``python bench/NAME.py``, insert it themselves.
"""
