"""Turns a stopped training run's ``checkpoint.pt`` into a model directory, the form of the ``final/`` it did not reach.

A stage writes ``OUT/final`` only when all its steps ran; a run stopped by ``--stop-after``, a
session's time limit or a crash leaves ``OUT/checkpoint.pt`` (written every ``--checkpoint-every``
steps and at ``--stop-after``). This command rebuilds the stage's model from the directory the
run started from (the stage's ``--model``, recorded in ``run.json``; ``--model`` here overrides
it) with the stage's own ``load_start_model``, loads the checkpoint's weights into it and writes
``--out`` with :func:`chatchat_policybert.model.loading.save_model_dir`: what ``PolicyBertEmbeddings``,
``chatchat-policybert eval`` and the next stage load. The stage is read from the checkpoint's
settings (each stage's config has its own fields); a ``run.json`` in the run folder (a crashed
first session has none) must record the same run.

    python -m training.export --run runs/pretrain --out runs/pretrain-step1000

``--router DIR`` also writes a sentence-transformers ``Router`` directory (:func:`export_router`): the exported model's
towers as the routes ``query`` and ``document`` (``encode_query`` / ``encode_document``), the form other tools load
asymmetric models in, without ``trust_remote_code``. With ``--model`` and no ``--run`` it converts an existing model
directory, its query tower carried along as the query route:

    python -m training.export --model models/policybert --router models/policybert-router

Each Router export records the files it wrote (``ROUTER_RECORD``, as ``training.import_e5`` records its own): a
later export replaces OUT only where OUT holds nothing else, so a user's folder, or an earlier export with a file
added, is refused with one line naming what is in the way, and nothing is deleted.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from chatchat_policybert.errors import InputError, run_cli
from training import contrastive, finetune, pretrain
from training.config import CHECKPOINT, RESUMABLE, RUN, TrainConfig, describe_changes, parse_flags

if TYPE_CHECKING:  # torch and the model load with a run, not with --help
    from transformers import PreTrainedModel

    from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer

ROUTER_RECORD = "router_export.json"
"""The files a Router export wrote into its directory, with their SHA-256
(:func:`chatchat_policybert.files.write_record`): what lets a later export replace that directory (issue 52 item 5)."""
ROUTER_WRITTEN_BY = "python -m training.export --router"
StartModel = Callable[[Path], "tuple[PreTrainedModel, PolicyBertTokenizer]"]
# Each stage: its config (whose fields name it in a checkpoint) and how it builds the model it trains.
STAGES: dict[str, tuple[type[TrainConfig], StartModel]] = {
    "pretrain": (pretrain.PretrainConfig, pretrain.load_start_model),
    "finetune": (finetune.FinetuneConfig, finetune.load_start_model),
    "contrastive": (contrastive.ContrastiveConfig, contrastive.load_start_model),
}


@dataclass
class ExportConfig:
    """The run folder to read, the directory the run started from, and where the model goes."""

    run: Path | None = field(
        default=None,
        metadata={"help": "the stopped run's --out folder (checkpoint.pt, and run.json where written)"},
    )
    out: Path | None = field(
        default=None,
        metadata={"help": "model directory to write (a model directory already there is replaced atomically)"},
    )
    model: Path | None = field(
        default=None,
        metadata={
            "help": "the directory the run started from, the stage's --model (default: the one "
            "RUN/run.json records; runs before it recorded one need it); without --run, the model directory "
            "--router converts"
        },
    )
    router: Path | None = field(
        default=None,
        metadata={
            "help": "also write a sentence-transformers Router directory here: --out's (or, without --run, --model's) "
            "query tower and document tower as the routes encode_query and encode_document take; a new path, an empty "
            f"folder, or an earlier Router export holding only the files its {ROUTER_RECORD} lists, which is replaced "
            "atomically (anything else there, or a symbolic link, is refused before any work)"
        },
    )

    def __post_init__(self) -> None:
        self.run, self.out, self.model, self.router = (
            None if value is None else Path(value) for value in (self.run, self.out, self.model, self.router)
        )
        if self.run is None and (self.model is None or self.router is None or self.out is not None):
            raise InputError(
                "expected --run RUN --out DIR (a stopped run's export), or --model DIR --router OUT (a model "
                "directory as a sentence-transformers Router directory)"
            )
        if self.run is not None and self.out is None:
            raise InputError(f"--run {self.run}: expected --out DIR, the model directory to write")


def defaults(config_class: type[TrainConfig]) -> dict[str, object]:
    """The config's fields that settings may lack: those saved before a field was added ran with its default."""
    return {
        f.name: f.default if f.default is not MISSING else f.default_factory()
        for f in fields(config_class)
        if f.default is not MISSING or f.default_factory is not MISSING
    }


def stage_of(settings: dict, source: Path) -> str:
    """The stage whose config has the fields of ``settings`` (a checkpoint's or ``run.json``'s).

    Settings written before a field was added to the configs lack it: a stage fits when its config
    has every saved name and defaults for the rest, and the one missing the fewest fields wins
    (finetune's config adds nothing to :class:`training.loop.TrainConfig`, the others do, so a
    finetune run fits pretrain too, with more missing).
    """
    names, fits = set(settings), {}
    for stage, (config_class, _) in STAGES.items():
        known = {f.name for f in fields(config_class)}
        if names <= known and known - names <= defaults(config_class).keys():
            fits[stage] = len(known - names)
    best = [stage for stage, count in fits.items() if count == min(fits.values())]
    if len(best) > 1:
        raise InputError(f"{source}: its settings fit {' and '.join(best)} alike; expected the settings of one stage")
    if not best:
        expected = ", ".join(f"training.{stage}" for stage in STAGES)
        raise InputError(f"{source}: its settings are those of none of the stages; expected a run of {expected}")
    return best[0]


def read_checkpoint(path: Path) -> dict:
    """``checkpoint.pt`` as :func:`training.loop.train` writes it, refused (one line) when missing or not one."""
    from training.loop import read_checkpoint_file

    saved = read_checkpoint_file(
        path,
        "cpu",
        missing="no checkpoint (a run writes one every --checkpoint-every steps and at --stop-after); "
        "expected the --out folder of a training run",
    )
    if not (
        isinstance(saved, dict) and all(isinstance(saved.get(part), dict) for part in ("config", "model", "state"))
    ):
        raise InputError(f"{path}: not a training checkpoint (expected training.loop's: config, model, state)")
    return saved


def read_run(run_json: Path) -> dict | None:
    """``run.json`` as :func:`training.loop.train` writes it, ``None`` where there is none (a crashed first session)."""
    if not run_json.is_file():
        return None
    try:
        run = json.loads(run_json.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(
            f"{run_json}: not a run record ({exc.__class__.__name__}); expected training.loop's run.json"
        ) from None
    if not (isinstance(run, dict) and isinstance(run.get("config"), dict)):
        raise InputError(f"{run_json}: not a run record; expected training.loop's run.json with its config")
    return run


def check_same_run(checkpoint: Path, stage: str, settings: dict, run_json: Path, recorded: dict) -> None:
    """Refuses a ``run.json`` of another run than the checkpoint's (a folder reused for another stage or other
    settings).

    Settings a resumed session may change (:data:`training.loop.RESUMABLE`) are not compared: the
    checkpoint may come from a later session than ``run.json``. A setting one side lacks (written
    before the field was added) counts as the stage's default, which is what that session ran with.
    """
    ran = stage_of(recorded, run_json)
    if ran != stage:
        raise InputError(
            f"{checkpoint}: a {stage} checkpoint, but {run_json} records a {ran} run; expected one run's folder"
        )
    default = defaults(STAGES[stage][0])
    compared = sorted((recorded.keys() | settings.keys()) - RESUMABLE)
    pairs = {k: (recorded.get(k, default.get(k)), settings.get(k, default.get(k))) for k in compared}
    changed = {k: (old, new) for k, (old, new) in pairs.items() if old != new}
    if changed:
        raise InputError(
            f"{checkpoint}: written with other settings than {run_json} records ({describe_changes(changed)}); "
            "expected one run's folder"
        )


def check_out(out: Path) -> None:
    """Like every stage's ``final/``, ``--out`` is replaced atomically, but only a model directory is.

    ``save_model_dir`` removes whatever was there: a mistyped ``--out`` (the run folder itself, or a
    folder of runs) would take the checkpoint with it.
    """
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: is a file; expected a new path or a model directory to replace")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise InputError(
            f"--out {out}: a non-empty folder that is not a model directory; expected a new path or a model directory "
            "to replace"
        )


def check_router_out(out: Path) -> None:
    """``--router`` is replaced atomically, and only where it is new, empty, or an earlier Router export holding
    exactly the files its :data:`ROUTER_RECORD` lists (:func:`chatchat_policybert.files.check_replaceable`): a folder
    that merely holds a ``router_config.json`` (a user's, even ``{}``) kept its other files only until the swap deleted
    them (issue 52, E8/E6), and a symbolic link cannot be swapped (E9). One line naming what is in the way."""
    from chatchat_policybert.files import check_replaceable

    check_replaceable(out, "--router", ROUTER_RECORD, ROUTER_WRITTEN_BY, "a Router directory")


def start_model(cfg: ExportConfig, run: dict | None) -> Path:
    """``--model``, else the start directory ``run.json`` records (absolute, as :func:`training.loop.train` writes
    it)."""
    if cfg.model is not None:
        return cfg.model
    inputs = (run or {}).get("inputs")
    recorded = inputs.get("model") if isinstance(inputs, dict) else None
    if not isinstance(recorded, str):
        raise InputError(
            f"--run {cfg.run}: no run.json recording the directory the run started from (a crashed first session, or a "
            "run before run.json recorded it); pass --model START_DIR"
        )
    return Path(recorded)


def export(cfg: ExportConfig) -> tuple[str, int]:
    """Writes ``cfg.out`` from the run's checkpoint; returns the stage and the step the checkpoint was taken at."""
    from chatchat_policybert.model.loading import save_model_dir

    check_out(cfg.out)
    checkpoint = cfg.run / CHECKPOINT
    saved = read_checkpoint(checkpoint)
    stage = stage_of(saved["config"], checkpoint)
    run = read_run(cfg.run / RUN)
    if run is not None:
        check_same_run(checkpoint, stage, saved["config"], cfg.run / RUN, run["config"])
    start = start_model(cfg, run)
    model, tokenizer = STAGES[stage][1](start)
    expected, weights = model.state_dict(), saved["model"]
    reshaped = {k for k in expected.keys() & weights.keys() if expected[k].shape != weights[k].shape}
    misfits = sorted((expected.keys() ^ weights.keys()) | reshaped)
    if misfits:
        raise InputError(
            f"{checkpoint}: its weights do not fit --model {start} "
            f"({len(misfits)} tensors missing, extra or of another shape, e.g. {misfits[0]}); "
            f"expected the directory the {stage} run started from"
        )
    model.load_state_dict(weights)
    instruction = saved["config"].get("query_instruction")
    if stage == "contrastive" and instruction is not None:
        # Served with the query instruction it trained with, as its final/ would be; None trained with the start
        # directory's, which the tokenizer loaded from it carries (with its document prompt and pooling).
        tokenizer.query_instruction = instruction
    save_model_dir(model, tokenizer, cfg.out)
    return stage, saved["state"]["step"]


def export_router(model_dir: Path, out: Path) -> Path:
    """Write ``model_dir`` (a model directory, with or without a query tower) to ``out`` as a sentence-transformers
    ``Router`` directory, atomically: ``SentenceTransformer(out).encode_query`` embeds as ``PolicyBertEmbeddings``'
    ``embed_query`` does (the query tower), ``encode_document`` as ``embed_documents`` (the document tower).

    The routes are the directory's own Transformer module, the query route's with the query tower's tensors; the
    pooling and normalisation after them are shared, and so are the prompts. Why a separate export, not the
    project's format: ``Router`` saves each route's weights in full, the piece embeddings twice (docs/model.md, "Two
    towers", has the sizes). Only sentence-transformers' own classes are named, so it loads without
    ``trust_remote_code``.
    """
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.router import Router

    from chatchat_policybert.files import atomic_path, write_record
    from chatchat_policybert.model.lexicon import LEXICON_FILE
    from chatchat_policybert.model.loading import load_towers

    check_router_out(out)
    document, query, _ = load_towers(model_dir)
    shared = document.state_dict()
    tuned = {k: v for k, v in query.state_dict().items() if v.data_ptr() != shared[k].data_ptr()}
    sentence_model = SentenceTransformer(str(model_dir), device="cpu")
    transformer, *after = sentence_model
    query_transformer = copy.deepcopy(transformer)
    query_transformer.auto_model.load_state_dict(tuned, strict=False)
    routed = SentenceTransformer(
        modules=[Router.for_query_document([query_transformer], [transformer]), *after],
        device="cpu",
        prompts=sentence_model.prompts,
        similarity_fn_name=sentence_model.similarity_fn_name,
    )
    lexicon = Path(model_dir) / LEXICON_FILE
    with atomic_path(out) as scratch:
        routed.save(str(scratch))
        # The tokenizer's save_pretrained writes tokenizer.json, not the lexicon: without it a route's AutoTokenizer
        # would give no word inputs and a PolicyBERT route would embed as plain BERT.
        for route in (folder for folder in scratch.iterdir() if (folder / "tokenizer_config.json").is_file()):
            if lexicon.is_file():
                shutil.copyfile(lexicon, route / LEXICON_FILE)
        write_record(scratch, ROUTER_RECORD, ROUTER_WRITTEN_BY, {"model": str(Path(model_dir).absolute())})
        check_router_out(out)  # again just before the swap: a file put there while it converted is kept too
    return out


def main(argv: list[str] | None = None) -> None:
    cfg = parse_flags(ExportConfig, argv, "python -m training.export", __doc__.split("\n\n")[0])
    if cfg.router is not None:
        check_router_out(cfg.router)  # before the run's export, which would otherwise be written first
    if cfg.run is not None:
        stage, step = export(cfg)
        print(f"{stage} run {cfg.run} at step {step}: model → {cfg.out}")
    if cfg.router is not None:
        export_router(cfg.model if cfg.run is None else cfg.out, cfg.router)
        print(f"sentence-transformers Router directory (encode_query / encode_document) → {cfg.router}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
