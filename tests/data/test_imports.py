"""The core package never imports torch (or the optional tokenizer libraries) at import time."""

from __future__ import annotations

import json
import subprocess
import sys

CORE = [
    "mcore_data",
    "mcore_data.indexed",
    "mcore_data.gpt_dataset",
    "mcore_data.blended",
    "mcore_data.builder",
    "mcore_data.preprocess",
    "mcore_data.tokenizer",
    "mcore_data.cli",
    "mcore_data.torch",
    "mcore_data.chat",
    "mcore_data.multimodal",
    "mcore_data.multimodal_prep",
    "mcore_data.multimodal_torch",
]


def test_core_modules_do_not_import_torch() -> None:
    code = (
        "import importlib, json, sys\n"
        f"for m in {CORE!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'sentencepiece', 'tokenizers', 'tqdm'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []


def test_public_api() -> None:
    import mcore_data

    for name in mcore_data.__all__:
        assert hasattr(mcore_data, name), name
