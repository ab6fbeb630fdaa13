"""``tune``'s step 3, the candidate: a Chatchat root like the deployment's serving the trained model, its knowledge
base rebuilt and its ensemble calibrated like the deployment's (:func:`~chatchat_policybert.deploy.calibration.
candidate_questions`: the questions the deployment was calibrated on, else the dev pairs;
:mod:`chatchat_policybert.deploy.calibration`).

Nothing of the deployment changes here: the candidate root is in the run folder, and on pg its
tables are in a schema of their own in the deployment's database
(:class:`chatchat_policybert.stores.pg_schema.OwnSchema`), dropped once the gate's decision is
carried out (:func:`release_candidates`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from chatchat_policybert.chatchat.config import SettingsDocs, copy_settings
from chatchat_policybert.chatchat.process import chatchat_command, run_chatchat
from chatchat_policybert.chatchat.root import content_dir
from chatchat_policybert.configure.setup import SetupOptions, setup_root
from chatchat_policybert.deploy.calibration import calibrate_root, write_calibration
from chatchat_policybert.deploy.gate import GATE
from chatchat_policybert.deploy.questions import is_pairs_file
from chatchat_policybert.deploy.rollback import INSTALLED
from chatchat_policybert.deploy.run import Run
from chatchat_policybert.evaluation.gate_rule import DEV_PAIRS
from chatchat_policybert.files import read_json, write_json
from chatchat_policybert.stores import store_of
from chatchat_policybert.stores.base import CandidateCopy

CALIBRATION = "calibration.json"
"""In the candidate's folder: the calibration's chosen setting, metrics and table (written last: the step is done)."""


def pg_schema(run: Run, root: Path) -> CandidateCopy | None:
    """On a pg deployment, the schema of its database holding the tables of the candidate root ``root``; else None
    (:meth:`chatchat_policybert.stores.base.Store.candidate_schema`)."""
    return store_of(run.root).candidate_schema(run.root, root)


def release_candidates(run: Run) -> None:
    """On pg, removes every candidate root of the run folder and drops its schema (FAISS keeps them: they are files).

    Called once the gate's decision is carried out and before a new candidate is built, so the
    deployment's database keeps no copy of the knowledge base. The root goes first: a candidate
    root whose schema is gone would reach the deployment's own tables (see :class:`OwnSchema`).
    """
    for folder in sorted((run.out / "candidate").glob("*")):
        schema = pg_schema(run, folder / "root")
        if schema is not None:
            shutil.rmtree(folder / "root", ignore_errors=True)
            schema.drop()


def decided(run: Run, key: str, inputs: str) -> bool:
    """Whether the gate's decision on candidate ``key`` for these gate ``inputs``
    (:func:`chatchat_policybert.deploy.gate.gate_inputs`) is carried out (refused, or installed): its root is done.
    Other inputs decide again, on the candidate root."""
    gate, marker = run.out / GATE, run.out / INSTALLED
    decision = read_json(gate) if gate.is_file() else {}
    if decision.get("candidate") != key or decision.get("inputs") != inputs:
        return False
    return not decision["install"] or (marker.is_file() and read_json(marker).get("candidate") == key)


def step_candidate(run: Run, final: Path, key: str, calibrate_on: tuple[Path, Path | None], inputs: str) -> Path:
    """A root like the deployment's serving the candidate, its KB rebuilt and its ensemble calibrated on
    ``calibrate_on`` (questions, and the corpus their titles name: :func:`candidate_questions`).

    On pg its tables are in a schema of their own in the deployment's database (:class:`OwnSchema`),
    so its `kb -r` and searches never touch the deployment's collection. A built root calibrated on
    other questions (the deployment's calibration changed since) is calibrated again, not rebuilt.
    """
    folder = run.out / "candidate" / key
    root = folder / "root"
    schema = pg_schema(run, root)
    if (folder / CALIBRATION).is_file():
        if schema is None or (root.is_dir() and schema.exists()):
            if read_json(folder / CALIBRATION).get("source") == str(calibrate_on[0].resolve()):
                print(f"candidate: {root} is already built and calibrated")
                return root
            print(f"candidate: {root} is built; calibrating it on {calibrate_on[0]}, as the deployment is")
            return calibrate_candidate(run, final, root, folder, calibrate_on)
        if decided(run, key, inputs):
            print(f"candidate: not needed, the gate decided on it already ({run.out / GATE})")
            return root
    release_candidates(run)  # pg: earlier candidates' schemas, a half-built one's included
    shutil.rmtree(folder, ignore_errors=True)  # a half-built one from a killed run
    settings = folder / "settings"
    copy_settings(run.root, settings)
    if schema is not None:
        copied = SettingsDocs(settings)
        copied.kb["kbs_config"]["pg"]["connection_uri"] = schema.create()
        copied.write()
        print(f"candidate: its pg tables are in the schema {schema.name} of the deployment's database")
    root.mkdir()
    run_chatchat(chatchat_command("init"), root, "chatchat init (candidate root)")
    setup_root(root, SetupOptions(model=final, settings_dir=settings))
    shutil.copytree(content_dir(run.root, run.kb), content_dir(root, run.kb), dirs_exist_ok=True)
    run_chatchat(
        chatchat_command("kb", "-r", "-n", run.kb), root, f"chatchat kb -r -n {run.kb} (candidate root)", progress=True
    )
    run.command(
        f"CHATCHAT_ROOT={root} chatchat init && chatchat-policybert setup --model {final} "
        f"--settings-dir {settings} && cp -r <KB content> && chatchat kb -r -n {run.kb}"
    )
    return calibrate_candidate(run, final, root, folder, calibrate_on)


def calibrate_candidate(
    run: Run, final: Path, root: Path, folder: Path, calibrate_on: tuple[Path, Path | None]
) -> Path:
    """Calibrates the built candidate ``root`` on ``calibrate_on`` and records it (``CALIBRATION``, written last)."""
    questions, corpus = calibrate_on
    calibration = calibrate_root(root, run.kb, questions, folder, corpus)
    write_calibration(root, calibration)
    run.command(
        f"CHATCHAT_ROOT={root} chatchat-policybert setup --model {final} --settings-dir {folder / 'settings'} "
        f"--calibrate {questions}{f' --corpus {corpus}' if corpus else ''} --kb {run.kb}"
    )
    print(calibration.table())
    write_json(
        {
            "chosen": vars(calibration.chosen),
            "metrics": calibration.metrics(),
            "table": calibration.table(),
            "source": calibration.source,
            "on": DEV_PAIRS if is_pairs_file(questions) else questions.name,
            "questions": calibration.questions,
        },
        folder / CALIBRATION,
    )
    return root
