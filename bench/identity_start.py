"""What the identity start costs: an ``--init bge`` PolicyBERT vs the thesis start vs plain BERT, one run.

    python bench/identity_start.py                      # attn, 32 chunks of 250 characters, 3 repetitions
    python bench/identity_start.py --fusion gate --chunks 16 --json bench/results/identity_start.json

Three bge-base-sized models with random weights (speed does not depend on the values, and the
vectors are no bge vectors): a plain BERT, and two PolicyBERTs whose character encoder is that
BERT's, key for key, with 6 word layers over the real lexicon — one built as ``merge_bge --init
bge`` builds (fusion scales 0), one as ``--init thesis`` (scales 1, gate bias 5). They embed the
same policy chunks in turns (after one untimed warm-up each), repetition by repetition, in this
process; the median is reported with its ratio to plain BERT, and each model's largest vector
difference from plain BERT shows the identity at full size: 0 for ``--init bge``, large for the
thesis start.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed import BGE_BASE, REPO, corpus_chunks, machine_line

sys.path.insert(0, str(REPO))
from chatchat_policybert.data import LEXICON
from chatchat_policybert.model.configuration_policybert import FUSION_TYPES


def build(root: Path, texts: list[str], fusion: str) -> dict[str, Path]:
    """``plain`` BERT and the two PolicyBERT starts on the same character weights, as ``training.merge_bge`` sets
    them."""
    from transformers import BertConfig, BertModel

    from chatchat_policybert.model.configuration_policybert import PolicyBertConfig
    from chatchat_policybert.model.lexicon import Lexicon
    from chatchat_policybert.model.loading import save_model_dir
    from chatchat_policybert.model.modeling_policybert import PolicyBertModel
    from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer, build_char_tokenizer
    from training.merge_bge import INITS

    tokenizer = build_char_tokenizer(texts)
    lexicon = Lexicon.load(LEXICON)
    torch.manual_seed(0)
    plain = BertModel(BertConfig(vocab_size=len(tokenizer), **BGE_BASE))
    dirs = {"plain": save_model_dir(plain, PolicyBertTokenizer(tokenizer), root / "plain")}
    for init, values in INITS.items():
        torch.manual_seed(1)  # the same word stream and fusions for both starts
        config = PolicyBertConfig(
            vocab_size=len(tokenizer),
            word_vocab_size=len(lexicon),
            num_word_layers=6,
            fusion_type=fusion,
            **values,
            **BGE_BASE,
        )
        model = PolicyBertModel(config)
        missing, _ = model.load_state_dict(plain.state_dict(), strict=False)
        assert all(k.startswith(("word_", "fusion")) for k in missing), missing
        dirs[f"init {init}"] = save_model_dir(model, PolicyBertTokenizer(tokenizer, lexicon), root / init)
    return dirs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fusion", choices=FUSION_TYPES, default="attn", help="fusion of the two PolicyBERTs")
    parser.add_argument("--chars", type=int, default=250, help="characters per chunk")
    parser.add_argument("--chunks", type=int, default=32, help="chunks embedded per repetition")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (median reported)")
    parser.add_argument("--device", default="cpu", help="torch device")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
    from chatchat_policybert.model.tokenization_policybert import DEFAULT_QUERY_INSTRUCTION

    texts = corpus_chunks(args.chars, args.chunks)
    with tempfile.TemporaryDirectory(prefix="bench-identity-") as tmp:
        dirs = build(Path(tmp), texts + [DEFAULT_QUERY_INSTRUCTION], args.fusion)
        models = {name: PolicyBertEmbeddings(path, device=args.device, dtype="float32") for name, path in dirs.items()}
        seconds: dict[str, list[float]] = {name: [] for name in models}
        vectors = {name: np.asarray(model.embed_documents(texts[:2])) for name, model in models.items()}  # warm-up
        for _ in tqdm(range(args.reps), desc="repetitions"):
            for name, model in models.items():
                start = time.perf_counter()
                vectors[name] = np.asarray(model.embed_documents(texts))
                seconds[name].append(time.perf_counter() - start)
    plain = statistics.median(seconds["plain"])
    rows = [
        {
            "model": name,
            "median_s": statistics.median(s),
            "x_plain": statistics.median(s) / plain,
            "max_abs_diff_vs_plain": float(np.abs(vectors[name] - vectors["plain"]).max()),
        }
        for name, s in seconds.items()
    ]
    line = machine_line(args.device, torch.get_num_threads())
    print(f"{line}\n{args.chunks} chunks x {args.chars} chars, fusion {args.fusion}, median of {args.reps}, fp32")
    print(f"{'model':<12} {'median s':>9} {'x plain':>8} {'max |v - v_plain|':>18}")
    for r in rows:
        print(f"{r['model']:<12} {r['median_s']:>9.2f} {r['x_plain']:>8.3f} {r['max_abs_diff_vs_plain']:>18.2e}")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"machine": line, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1),
            encoding="utf-8",
        )


if __name__ == "__main__":
    main()
