"""Stage 4: MLM with whole-word masking over lexicon words + NSP, resumable.

Masking picks 15 % of the real tokens of each pair in units: a lexicon word matched in the text is
one unit (all its characters are predicted, or none), every other character is a unit of its own.
Each predicted token is replaced by ``[MASK]`` (80 %), a random character (10 %) or kept (10 %).
Words that cover a predicted token are removed from the word stream, which would otherwise hand the
model the answer. NSP pairs are consecutive sentences of one document, half of them (exactly)
with the second sentence replaced by one from another document. Held-out documents, never
trained on, give MLM loss / accuracy / perplexity and NSP accuracy after every epoch
(``metrics.json``). Every ``--checkpoint-every`` optimiser steps the full training state is saved;
``--resume`` continues from it to exactly the state an uninterrupted run would have reached.

    python -m training.pretrain --model runs/merged --corpus runs/corpus/corpus.jsonl --out runs/pretrain
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from chatchat_policybert.errors import InputError, run_cli
from chatchat_policybert.files import atomic_path
from chatchat_policybert.loading import ModelDirError, read_config, save_model_dir
from chatchat_policybert.modeling import PolicyBertForPreTraining
from chatchat_policybert.tokenization import PolicyBertTokenizer
from training._common import Document, read_corpus, seed_everything
from training._train import (
    TrainConfig,
    add_train_arguments,
    autocast,
    make_optimizer,
    optimizer_step,
    pick_device,
    pick_precision,
    write_json,
)

IS_NEXT, IS_RANDOM = 0, 1  # BERT's (and PolicyBertForPreTraining's) next_sentence_label convention
# Settings a resumed run may change: they do not alter the training trajectory.
RESUMABLE = {"stop_after", "checkpoint_every", "device", "eval_batch_size"}
WordSpan = tuple[int, int, int]  # (word id, first token, one past the last token), as PolicyBertTokenizer returns them


@dataclass
class PretrainConfig(TrainConfig):
    """Defaults are the thesis's (lr 3e-5, batch 32, 3 epochs).

    ``seed`` drives the training randomness (order, masks, dropout); ``data_seed`` the held-out
    documents, the NSP pairs and the held-out masks, so that runs with different seeds are scored
    on the very same held-out set.
    """

    lr: float = 3e-5
    grad_accum: int = 1
    mlm_probability: float = 0.15
    eval_fraction: float = 0.05
    checkpoint_every: int = 500
    stop_after: int | None = None
    shuffle_words: bool = True
    data_seed: int = 42


@dataclass(frozen=True)
class NspExample:
    a: str
    b: str
    label: int


def split_documents(docs: list[Document], eval_fraction: float, seed: int) -> tuple[list[Document], list[Document]]:
    """Holds out whole documents (at least two, for random NSP partners) with ≥ ``eval_fraction`` of the sentences."""
    usable = [doc for doc in docs if len(doc.sentences) >= 2]
    if len(usable) < 4:
        raise InputError(f"pre-training needs at least 4 documents with two sentences, the corpus has {len(usable)}")
    order = list(usable)
    random.Random(f"{seed}-heldout").shuffle(order)
    target = eval_fraction * sum(len(doc.sentences) for doc in usable)
    held, count = [], 0
    while len(held) < 2 or (count < target and len(order) - len(held) > 2):
        held.append(order[len(held)])
        count += len(held[-1].sentences)
    held_ids = {doc.doc_id for doc in held}
    return [doc for doc in usable if doc.doc_id not in held_ids], held


def nsp_examples(docs: list[Document], seed: int) -> list[NspExample]:
    """Consecutive sentence pairs, exactly half with B swapped for a sentence of another document."""
    rng = random.Random(f"{seed}-nsp")
    slots = [(d, i) for d, doc in enumerate(docs) for i in range(len(doc.sentences) - 1)]
    labels = [IS_RANDOM] * (len(slots) // 2) + [IS_NEXT] * (len(slots) - len(slots) // 2)
    rng.shuffle(labels)
    everywhere = [(d, s) for d, doc in enumerate(docs) for s in doc.sentences]
    examples = []
    for (d, i), label in zip(slots, labels):
        b = docs[d].sentences[i + 1]
        if label == IS_RANDOM:
            other = d
            while other == d:
                other, b = rng.choice(everywhere)
        examples.append(NspExample(docs[d].sentences[i], b, label))
    return examples


def whole_word_units(spans: list[WordSpan], candidates: list[int]) -> list[list[int]]:
    """Masking units: matched words (longest first, never overlapping) and the remaining single tokens."""
    allowed, covered, units = set(candidates), set(), []
    for _, first, last in sorted(spans, key=lambda s: (s[1] - s[2], s[1])):
        positions = range(first, last)
        if last - first > 1 and allowed.issuperset(positions) and covered.isdisjoint(positions):
            units.append(list(positions))
            covered.update(positions)
    units.extend([p] for p in candidates if p not in covered)
    return sorted(units)


def mask_units(
    input_ids: list[int], units: list[list[int]], rng: random.Random, probability: float, mask_id: int, replacements: list[int]
) -> tuple[list[int], list[int]]:
    """BERT's selection with whole units: up to ``probability`` of the tokens, no unit split; then 80/10/10."""
    budget = max(1, round(probability * sum(map(len, units))))
    order = list(units)
    rng.shuffle(order)
    chosen: list[int] = []
    for unit in order:
        if len(chosen) >= budget:
            break
        if len(chosen) + len(unit) <= budget:
            chosen.extend(unit)
    ids, labels = list(input_ids), [-100] * len(input_ids)
    for p in chosen:
        labels[p] = input_ids[p]
        draw = rng.random()
        if draw < 0.8:
            ids[p] = mask_id
        elif draw < 0.9:
            ids[p] = rng.choice(replacements)
    return ids, labels


def make_batch(
    tokenizer: PolicyBertTokenizer,
    examples: list[NspExample],
    keys: list[str],
    seed: int,
    cfg: PretrainConfig,
    shuffle_words: bool,
) -> dict[str, torch.Tensor]:
    """Tokenises, masks each example with a generator seeded by (``seed``, its key) and hides words over masked tokens.

    Seeding per example, not per run, makes a batch independent of what came before it, which is
    what lets ``--resume`` reproduce an uninterrupted run.
    """
    tok = tokenizer.tokenizer
    special = set(tok.all_special_ids)
    replacements = [i for i in range(len(tok)) if i not in special]
    word_seed = random.Random(f"{seed}-words-{keys[0]}").getrandbits(32)
    enc = tokenizer(
        [e.a for e in examples],
        [e.b for e in examples],
        max_length=cfg.max_length,
        shuffle_words=shuffle_words,
        seed=word_seed,
        return_word_spans=True,
    )
    spans = enc.pop("word_spans", None)
    input_ids, labels = [], []
    for i, key in enumerate(keys):
        ids = enc["input_ids"][i].tolist()
        mask = enc["attention_mask"][i].tolist()
        candidates = [p for p, (t, m) in enumerate(zip(ids, mask)) if m and t not in special]
        units = whole_word_units(spans[i] if spans else [], candidates)
        rng = random.Random(f"{seed}-mask-{key}")
        masked, target = mask_units(ids, units, rng, cfg.mlm_probability, tok.mask_token_id, replacements)
        input_ids.append(masked)
        labels.append(target)
    batch = dict(enc)
    batch["input_ids"] = torch.tensor(input_ids)
    batch["labels"] = torch.tensor(labels)
    batch["next_sentence_label"] = torch.tensor([e.label for e in examples])
    if "word_ids" in batch:
        predicted = (batch["labels"] != -100).float()
        leak = torch.einsum("btw,bt->bw", batch["word_matching_matrix"], predicted) > 0
        batch["word_ids"] = batch["word_ids"].masked_fill(leak, 0)
        batch["word_attention_mask"] = batch["word_attention_mask"].masked_fill(leak, 0)
        batch["word_matching_matrix"] = batch["word_matching_matrix"] * (~leak)[:, None, :]
    return batch


@torch.no_grad()
def evaluate(
    model: PolicyBertForPreTraining,
    tokenizer: PolicyBertTokenizer,
    examples: list[NspExample],
    cfg: PretrainConfig,
    device: torch.device,
    precision: str,
) -> dict[str, float]:
    """MLM loss, accuracy and perplexity over the masked tokens and NSP accuracy; masks are fixed by the seed."""
    model.eval()
    loss_sum = correct = masked = nsp_correct = 0.0
    for start in tqdm(range(0, len(examples), cfg.eval_batch_size), desc="evaluating", unit="batch", leave=False):
        chunk = examples[start : start + cfg.eval_batch_size]
        keys = [f"eval-{start + i}" for i in range(len(chunk))]
        batch = make_batch(tokenizer, chunk, keys, cfg.data_seed, cfg, shuffle_words=False)
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        nsp_labels = batch.pop("next_sentence_label")
        with autocast(precision, device):
            out = model(**batch)
        logits = out.prediction_logits.float()
        where = labels != -100
        loss_sum += torch.nn.functional.cross_entropy(logits[where], labels[where], reduction="sum").item()
        correct += (logits[where].argmax(-1) == labels[where]).sum().item()
        masked += where.sum().item()
        nsp_correct += (out.seq_relationship_logits.argmax(-1) == nsp_labels).sum().item()
    model.train()
    mlm_loss = loss_sum / max(masked, 1)
    return {
        "mlm_loss": round(mlm_loss, 4),
        "mlm_accuracy": round(correct / max(masked, 1), 4),
        "perplexity": round(math.exp(min(mlm_loss, 50.0)), 2),
        "nsp_accuracy": round(nsp_correct / len(examples), 4),
        "examples": len(examples),
        "masked_tokens": int(masked),
    }


def save_checkpoint(path: Path, model, optimizer, scheduler, scaler, state: dict, cfg: PretrainConfig) -> None:
    """Everything needed to continue bit for bit: weights, optimiser, schedule, scaler, RNG, position, settings."""
    payload = {
        "config": asdict(cfg),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "state": state,
    }
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


def pretrain(
    model: PolicyBertForPreTraining,
    tokenizer: PolicyBertTokenizer,
    docs: list[Document],
    cfg: PretrainConfig,
    out_dir: Path,
    resume: bool = False,
) -> tuple[list[dict], bool]:
    """Trains in place; returns the per-epoch metrics (also in ``out_dir/metrics.json``) and whether all steps ran."""
    if cfg.batch_size % cfg.grad_accum:
        raise InputError(f"--batch-size {cfg.batch_size} is not a multiple of --grad-accum {cfg.grad_accum}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    device = pick_device(cfg.device)
    precision = pick_precision(cfg.precision, device)
    train_docs, eval_docs = split_documents(docs, cfg.eval_fraction, cfg.data_seed)
    train, held_out = nsp_examples(train_docs, cfg.data_seed), nsp_examples(eval_docs, cfg.data_seed + 1)
    micro = cfg.batch_size // cfg.grad_accum
    batches_per_epoch = math.ceil(len(train) / micro)
    total_steps = cfg.max_steps or cfg.epochs * math.ceil(batches_per_epoch / cfg.grad_accum)

    model.to(device).train()
    optimizer, scheduler = make_optimizer(model, cfg.lr, cfg.weight_decay, total_steps, cfg.warmup_proportion)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    state = {"step": 0, "epoch": 0, "batch": 0, "loss_sum": 0.0, "loss_steps": 0, "history": []}
    checkpoint = out_dir / "checkpoint.pt"
    if resume:
        if not checkpoint.is_file():
            raise InputError(f"{checkpoint}: no checkpoint to resume from")
        try:
            saved = torch.load(checkpoint, map_location=device, weights_only=True)
        except Exception as exc:  # torch reports a truncated or foreign file as many different errors
            raise InputError(f"{checkpoint}: not a readable checkpoint ({exc.__class__.__name__}); delete it to start over") from None
        changed = {
            k: (v, saved["config"].get(k)) for k, v in asdict(cfg).items() if k not in RESUMABLE and saved["config"].get(k) != v
        }
        if changed:
            shown = ", ".join(f"{k} {old!r} -> {new!r}" for k, (new, old) in changed.items())
            raise InputError(f"{checkpoint}: was written with other settings ({shown}); resume with the same ones")
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        scaler.load_state_dict(saved["scaler"])
        torch.set_rng_state(saved["torch_rng"])
        if saved["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda_rng"])
        state = saved["state"]

    print(
        f"pre-training: {len(train)} NSP pairs from {len(train_docs)} documents, {len(held_out)} held-out pairs "
        f"from {len(eval_docs)} documents; {total_steps} steps of {cfg.batch_size} on {device} ({precision})"
    )
    bar = tqdm(total=total_steps, initial=state["step"], desc="pre-training", unit="step")
    stopped_early = False
    while state["step"] < total_steps:
        epoch = state["epoch"]
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch)).tolist()
        while state["batch"] < batches_per_epoch and state["step"] < total_steps:
            for _ in range(cfg.grad_accum):
                if state["batch"] >= batches_per_epoch:
                    break
                indices = order[state["batch"] * micro : (state["batch"] + 1) * micro]
                keys = [f"{epoch}-{i}" for i in indices]
                batch = make_batch(tokenizer, [train[i] for i in indices], keys, cfg.seed, cfg, cfg.shuffle_words)
                with autocast(precision, device):
                    loss = model(**{k: v.to(device) for k, v in batch.items()}).loss / cfg.grad_accum
                scaler.scale(loss).backward()
                state["loss_sum"] += loss.item()
                state["batch"] += 1
            optimizer_step(model, optimizer, scheduler, scaler)
            state["step"] += 1
            state["loss_steps"] += 1
            bar.update()
            bar.set_postfix(loss=f"{state['loss_sum'] / state['loss_steps']:.3f}")
            if state["step"] % cfg.checkpoint_every == 0 or state["step"] == cfg.stop_after:
                save_checkpoint(checkpoint, model, optimizer, scheduler, scaler, state, cfg)
            if state["step"] == cfg.stop_after and state["step"] < total_steps:
                stopped_early = True
                break
        if stopped_early:
            break
        finished_epoch = state["batch"] >= batches_per_epoch
        record = {
            "epoch": epoch + 1 if finished_epoch else round(epoch + state["batch"] / batches_per_epoch, 3),
            "step": state["step"],
            "train_loss": round(state["loss_sum"] / max(state["loss_steps"], 1), 4),
            "lr": scheduler.get_last_lr()[0],
            "held_out": evaluate(model, tokenizer, held_out, cfg, device, precision),
        }
        state["history"].append(record)
        write_json(state["history"], out_dir / "metrics.json")
        tqdm.write(f"epoch {record['epoch']}: {record['held_out']}")
        state.update(epoch=epoch + 1, batch=0, loss_sum=0.0, loss_steps=0)
    bar.close()
    if stopped_early:
        print(f"stopped after step {state['step']} of {total_steps}; continue with --resume")
    else:
        save_checkpoint(checkpoint, model, optimizer, scheduler, scaler, state, cfg)
    write_json({"config": asdict(cfg), "train_pairs": len(train), "held_out_pairs": len(held_out)}, out_dir / "run.json")
    return state["history"], not stopped_early


def load_model(path: Path) -> tuple[PolicyBertForPreTraining, PolicyBertTokenizer]:
    """A PolicyBERT directory (e.g. from ``training.merge_bge``) with its tokenizer and lexicon."""
    try:
        config = read_config(Path(path))
    except ModelDirError as exc:
        raise InputError(str(exc)) from None
    if config["model_type"] != "policybert":
        raise InputError(f"{path}: model_type {config['model_type']!r}; build a PolicyBERT dir first with training.merge_bge")
    return PolicyBertForPreTraining.from_pretrained(path), PolicyBertTokenizer.from_pretrained(path)


def main(argv: list[str] | None = None) -> None:
    defaults = PretrainConfig()
    parser = argparse.ArgumentParser(prog="python -m training.pretrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="PolicyBERT dir to start from (training.merge_bge output)")
    parser.add_argument("--corpus", type=Path, required=True, help="corpus.jsonl from training.corpus")
    parser.add_argument("--out", type=Path, required=True, help="folder for checkpoint.pt, metrics.json and final/")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    add_train_arguments(parser, defaults)
    parser.add_argument("--grad-accum", type=int, default=defaults.grad_accum, help="micro-batches per step")
    parser.add_argument("--mlm-probability", type=float, default=defaults.mlm_probability)
    parser.add_argument("--eval-fraction", type=float, default=defaults.eval_fraction, help="share of sentences held out")
    parser.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every, help="optimiser steps")
    parser.add_argument("--stop-after", type=int, help="checkpoint and exit after this step (for time-limited sessions)")
    parser.add_argument("--no-shuffle-words", dest="shuffle_words", action="store_false", help="keep words in text order")
    parser.add_argument("--data-seed", type=int, default=defaults.data_seed, help="held-out documents and NSP pairs")
    args = vars(parser.parse_args(argv))
    model_dir, corpus, out, resume = args.pop("model"), args.pop("corpus"), args.pop("out"), args.pop("resume")
    cfg = PretrainConfig(**args)

    docs = read_corpus(corpus)
    model, tokenizer = load_model(model_dir)
    _, finished = pretrain(model, tokenizer, docs, cfg, out, resume=resume)
    if finished:
        save_model_dir(model, tokenizer, out / "final")
        print(f"model → {out / 'final'}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
