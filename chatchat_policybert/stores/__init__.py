"""The vector stores Chatchat keeps PolicyBERT's vectors in (FAISS, PostgreSQL + pgvector): the transactional
``kb -r`` (staging + swap), stored vectors, the score threshold ↔ cosine mapping and pg's search patch."""
