"""Run a loader in a Python whose path does not hold rope_quant (the export stands alone).

``python -I -S``: no environment variables, no user site, no cwd on the path and no ``site`` processing, so
neither the venv's ``.pth`` files (the editable install's finder) nor this checkout can put rope_quant on the
path. The script then adds only the venv's site-packages directories and asserts ``import rope_quant`` fails.
"""

from __future__ import annotations

import json
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

PRELUDE = """
import sys
sys.path[:0] = {paths!r}
import importlib.util
assert importlib.util.find_spec("rope_quant") is None, "rope_quant is importable in the isolated interpreter"
try:
    import rope_quant  # noqa: F401
except ImportError:
    pass
else:
    raise AssertionError("import rope_quant succeeded in the isolated interpreter")
import json, time, torch
"""

LOAD_HF = """
from transformers import AutoModelForCausalLM
ids = torch.load({ids!r})
t = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained({path!r}, dtype={dtype}).eval()
load_s = time.perf_counter() - t
with torch.no_grad():
    logits = model(input_ids=ids).logits
torch.save(logits, {logits!r})
state = {{k: v for k, v in model.state_dict().items()}}
print(json.dumps({{"load_s": load_s, "class": type(model).__name__,
                  "has_rope_quant": "rope_quant" in sys.modules, "n_params": sum(v.numel() for v in state.values())}}))
"""


def site_paths() -> list[str]:
    """The venv's site-packages directories (where transformers and compressed-tensors live)."""
    return [p for p in site.getsitepackages() if Path(p).is_dir()]


def run_isolated(body: str, tmp: Path, timeout: float = 600) -> dict:
    """Run ``PRELUDE + body`` under ``python -I -S`` in ``tmp``; return the JSON of its last stdout line."""
    script = tmp / "isolated_load.py"
    script.write_text(textwrap.dedent(PRELUDE.format(paths=site_paths())) + textwrap.dedent(body))
    proc = subprocess.run([sys.executable, "-I", "-S", str(script)], cwd=tmp, capture_output=True, text=True,
                          timeout=timeout, env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                                                "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def hf_logits(path: Path, ids: torch.Tensor, tmp: Path, dtype: str = "torch.float32") -> tuple[torch.Tensor, dict]:
    """Load the checkpoint at ``path`` in the isolated interpreter (``dtype``: a Python expression, e.g.
    ``"'auto'"`` for the stored dtype); its logits on ``ids`` and facts (load time, class)."""
    ids_file, logits_file = tmp / "ids.pt", tmp / "logits.pt"
    torch.save(ids, ids_file)
    info = run_isolated(LOAD_HF.format(ids=str(ids_file), path=str(path), logits=str(logits_file), dtype=dtype),
                        tmp)
    assert info["has_rope_quant"] is False
    return torch.load(logits_file), info


def byte_tokenizer():
    """A saveable byte-level tokenizer (one id per byte, 256 ids): a real tokenizer for tiny checkpoint dirs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    chars = {b: chr(b if b in printable else next(extra)) for b in range(256)}  # the byte-level alphabet
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)
