"""What the load-time SHA-256 check of ``model.safetensors`` costs (issue 52 item 7), on the e5 base.

    python -m training.import_e5 --out /tmp/e5          # the e5 base (470 MB of weights), recorded
    python bench/weights_checksum.py /tmp/e5            # 3 fresh processes per case, median

Each case runs in a fresh process (a process remembers the digests it computed, ``files.file_sha256``), with the file
in the page cache (the first, uncounted run reads it): ``file_sha256`` alone; ``load_towers`` on the directory (the
record checked, the weights hashed once); the same directory with the checksum taken out of its record (the load
before this check existed); ``load_towers`` twice in one process (the second remembered); and sentence-transformers,
whose tokenizer and model each check the record (hashed once, then remembered).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TOWERS = "from chatchat_policybert.model.loading import load_towers; "
ST = "from sentence_transformers import SentenceTransformer; "
CASES = {
    "sha256 of model.safetensors": (
        "from chatchat_policybert.files import file_sha256; t(lambda: file_sha256(D / 'model.safetensors'))"
    ),
    "load_towers, checksum recorded": TOWERS + "t(lambda: load_towers(D))",
    "load_towers, no checksum recorded": TOWERS + "t(lambda: load_towers(OLD))",
    "load_towers again, same process": TOWERS + "load_towers(D); t(lambda: load_towers(D))",
    "SentenceTransformer, checksum recorded": ST + "t(lambda: SentenceTransformer(str(D), device='cpu'))",
    "SentenceTransformer, no checksum recorded": ST + "t(lambda: SentenceTransformer(str(OLD), device='cpu'))",
}
PRELUDE = """
import sys, time
from pathlib import Path
D, OLD = Path(sys.argv[1]), Path(sys.argv[2])
def t(f):
    start = time.perf_counter(); f(); print(time.perf_counter() - start)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path, help="a model directory whose config.json records model.safetensors")
    parser.add_argument("--reps", type=int, default=3, help="fresh processes per case")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        old = Path(shutil.copytree(args.model_dir, Path(scratch) / "old", copy_function=shutil.copy2))
        config = json.loads((old / "config.json").read_text(encoding="utf-8"))
        del config["policybert_files"]["model.safetensors"]
        (old / "config.json").write_text(json.dumps(config), encoding="utf-8")
        for label, code in CASES.items():
            run = [sys.executable, "-c", PRELUDE + code, str(args.model_dir), str(old)]
            subprocess.run(run, check=True, capture_output=True)  # page cache warm
            times = [
                float(subprocess.run(run, check=True, capture_output=True, text=True).stdout) for _ in range(args.reps)
            ]
            print(
                f"{label:<42} median {statistics.median(times):.3f} s  (runs: {', '.join(f'{x:.3f}' for x in times)})"
            )


if __name__ == "__main__":
    main()
