"""``from chatchat_policybert import PolicyBertEmbeddings``: the public name, resolved lazily.

The start-up hook imports the package in every Python process, so the package's own import must
load neither torch nor transformers; the class is imported only when the name is asked for.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


@pytest.mark.slow  # a Python process of its own
def test_importing_the_package_loads_no_torch():
    assert run("import sys, chatchat_policybert; print('torch' in sys.modules, 'transformers' in sys.modules)") == (
        "False False"
    )


@pytest.mark.slow  # a Python process of its own
def test_the_top_level_name_is_the_embeddings_class():
    code = (
        "from chatchat_policybert import PolicyBertEmbeddings\n"
        "from chatchat_policybert.model.embeddings import PolicyBertEmbeddings as Real\n"
        "print(PolicyBertEmbeddings is Real)"
    )
    assert run(code) == "True"


def test_an_unknown_name_is_an_attribute_error():
    import chatchat_policybert

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        chatchat_policybert.Nope  # noqa: B018
