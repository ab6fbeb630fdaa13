"""``tune``'s step 5, install: the candidate the gate passed becomes what the root serves, and nothing ungated stays.

The previous model, settings and vectors are kept first (``OUT/previous``, what
``chatchat-policybert rollback`` restores: :mod:`chatchat_policybert.deploy.rollback`, which must
agree with this step byte for byte), the candidate model is copied into ``ROOT/models/``, the
settings point at it with the calibrated weights, and the KB is rebuilt with the transactional
``chatchat kb -r``; a failed rebuild puts the settings back, and a rebuild whose vectors differ
from the gated candidate's puts the whole previous deployment back.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from chatchat_policybert.chatchat.config import kb_settings, served_model
from chatchat_policybert.chatchat.process import chatchat_command, run_chatchat
from chatchat_policybert.deploy.calibration import update_settings
from chatchat_policybert.deploy.rollback import (
    BACKUP_DIR,
    INSTALL_STARTED,
    INSTALLED,
    ROLLED_BACK,
    kb_vectors,
    restore_backup,
    restore_settings,
    save_backup,
)
from chatchat_policybert.deploy.run import Run, now
from chatchat_policybert.errors import InputError
from chatchat_policybert.files import atomic_path, write_json
from chatchat_policybert.retrieval.hybrid import configured_hybrid


def step_install(run: Run, final: Path, candidate: Path, key: str) -> None:
    """Keeps the previous deployment, installs the candidate with its calibrated settings, rebuilds the KB."""
    marker = run.out / INSTALLED
    models = run.root / "models"
    installed = models / f"policybert-{run.kb}-{key}"
    if run.record(INSTALLED).get("candidate") == key:
        served = served_model(run.root)[1]
        if served == installed:
            print(f"install: done already ({installed} serves {run.kb})")
            return
        print(f"install: {installed} was installed but the root serves {served}: installing it again", flush=True)
        marker.unlink()
    rolled_back = run.record(ROLLED_BACK)
    if rolled_back.get("candidate") == key:
        print(
            f"install: this candidate was installed and rolled back ({rolled_back.get('rolled_back')}); installing it "
            f"again (`chatchat-policybert rollback --kb {run.kb}` undoes it again)",
            flush=True,
        )
    backup = run.out / BACKUP_DIR
    started = run.out / INSTALL_STARTED
    if run.record(INSTALL_STARTED).get("candidate") != key:
        save_backup(run.root, run.kb, backup)  # before anything in the root changes
        write_json({"candidate": key}, started)
    if not (installed / "config.json").is_file():
        with atomic_path(installed) as tmp:
            shutil.copytree(final, tmp)
    hybrid = configured_hybrid(candidate)
    threshold = kb_settings(candidate).score_threshold
    update_settings(run.root, hybrid=hybrid, threshold=threshold, model_path=str(installed.relative_to(run.root)))
    embed_model, _ = served_model(run.root)
    try:
        run_chatchat(chatchat_command("kb", "-r", "-n", run.kb), run.root, f"chatchat kb -r -n {run.kb}", progress=True)
    except (InputError, OSError, RuntimeError) as exc:
        restore_settings(run.root, backup)
        raise InputError(
            f"install failed, settings put back (the transactional kb -r kept the previous index): {exc}"
        ) from None
    # The rebuild must give the very vectors the gate saw in the candidate root (same model, documents, settings);
    # where it did not, what is served was never gated: the whole previous deployment goes back, vectors included.
    if kb_vectors(run.root, run.kb, embed_model) != kb_vectors(candidate, run.kb, embed_model):
        identical = restore_backup(run.root, backup)
        raise InputError(
            f"install refused: `chatchat kb -r -n {run.kb}` gave other vectors than the gated candidate's; the "
            "previous model, settings and index are back"
            + ("" if identical else f" (but its vectors differ from the saved ones: see {backup})")
        )
    run.command(f"chatchat kb -r -n {run.kb}")
    write_json({"candidate": key, "model": str(installed), "at": now()}, marker)
    (run.out / ROLLED_BACK).unlink(missing_ok=True)
    print(
        f"install: {installed} serves {run.kb}; `chatchat-policybert rollback --kb {run.kb}` restores the previous one"
    )
