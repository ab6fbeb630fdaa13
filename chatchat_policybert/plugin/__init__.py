"""What runs inside Chatchat's own processes: the start-up import hook that wires every patch in, the worker
that runs Chatchat's chunking, search and RAG chain for a root, and the API's warm-up."""
