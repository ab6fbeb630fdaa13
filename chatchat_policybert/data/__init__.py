"""The data the project ships: the policy corpus, the reference lexicon and stopwords, a PolicySM
sample and the evaluation questions (Apache-2.0, notice in ``LICENSE-policy-data.txt`` here).

Package data, so that a wheel installed anywhere runs ``chatchat-policybert eval`` and the demo
without the repository beside it. Paths only: nothing is read at import.
"""

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
LICENSE = DATA_DIR / "LICENSE-policy-data.txt"
CORPUS_CSV = DATA_DIR / "policy_corpus" / "Policys_cleaned.csv"
LEXICON = DATA_DIR / "lexicon" / "words_list_checked.txt"
STOPWORDS = DATA_DIR / "lexicon" / "stopword.txt"
POLICY_SM_DEV = DATA_DIR / "policy_sm" / "dev.tsv"
QUESTIONS = DATA_DIR / "policy_questions.jsonl"
TRAINING_QUESTIONS = DATA_DIR / "policy_training_questions.jsonl"
"""213 colloquial questions on 60 of the KB's 80 documents (drawn at random: ``training_documents_2026-11-27.json``
lists them and the 20 left out), what the demo's ``tune`` trains the query tower on (README, "Tuning")."""
TRAINING_DOCUMENTS = DATA_DIR / "training_documents_2026-11-27.json"
