"""Offline pipeline that turns policy documents into PolicyBERT weights.

Stages, in the order of the recipe, each ``python -m training.<stage> --help`` (their one numbering):

0. ``init_scratch`` — a character-only BERT from scratch, the stand-in for bge where bge's weights
   cannot be had (a plain BERT directory that ``pretrain``, ``contrastive`` and ``merge_bge --bge`` take).
1. ``corpus``   — clean documents, drop duplicates, split into sentences (``corpus.jsonl``).
2. ``build_lexicon`` — segment the corpus (HanLP, or jieba on request) into a ``word,count`` lexicon.
3. ``policysm`` — PolicySM-1/-2 sentence-pair TSVs from comma sub-clauses.
4. ``pretrain`` — MLM (whole-word masking over lexicon words) + NSP pre-training, resumable.
5. ``finetune`` — NSP sentence-pair classification on a PolicySM TSV folder.
6. ``merge_bge`` — build PolicyBERT from any BERT-family base, bge's or e5's (``--init bge`` starts as exactly
   the base), or merge a fine-tuned one back with an ``--alpha`` chosen on dev questions.
7. ``pairs``    — retrieval training pairs (inverse cloze, headings, optional LLM questions) with
   hard negatives that never come from the positive's document, FlagEmbedding's line format.
8. ``contrastive`` — InfoNCE retrieval training on those pairs, on the vectors the runtime serves.

Each stage is a function of its config dataclass (its ``run``, or ``init_scratch``/``export``);
``main(argv)`` only parses flags into it with ``config.parse_flags``. ``config`` holds the shared
settings and the flags mechanism (light: ``--help`` loads no torch); ``loop`` is the one training
loop the stages share; ``export`` turns a stopped run's ``checkpoint.pt`` into a model directory.
``ablate`` picks an ablation by ``--task``: ``ablate_fusion``, a small from-scratch replication of
the fusion comparison on CPU, or ``ablate_retrieval``. ``demo_model`` builds the demo's model (the
runtime reaches it by entry point). ``tune`` is ``chatchat-policybert tune``.
The runtime package ``chatchat_policybert`` never imports this package.
"""
