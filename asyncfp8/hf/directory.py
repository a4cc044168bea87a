"""An HF model directory checked before transformers reads it (errors that say what is
wrong and how to fix it, instead of a traceback from deep inside transformers or the hub
client), and its tokenizer. Without torch, so that the tasks, which render chat
templates with the tokenizer, stay light."""

from __future__ import annotations

import json
from pathlib import Path

MAKE_ONE = "make one with `python -m asyncfp8.models.tiny --out DIR`"


def check_model_dir(path: str | Path) -> Path:
    """`path` as a Path if it holds an HF causal LM (config.json, weights, tokenizer)."""
    model_dir = Path(path).expanduser()
    if not model_dir.exists():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist; {MAKE_ONE}")
    if not model_dir.is_dir():
        raise NotADirectoryError(
            f"model path {str(model_dir)!r} is a file; expected an HF model directory"
        )
    config = model_dir / "config.json"
    if not config.is_file():
        raise FileNotFoundError(
            f"{str(model_dir)!r} has no config.json, so it is not an HF model directory "
            f"(save_pretrained output); {MAKE_ONE}"
        )
    try:
        json.loads(config.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config}: not valid JSON ({err.msg}, line {err.lineno})") from None
    if not any(model_dir.glob("*.safetensors")) and not any(model_dir.glob("*.bin")):
        raise FileNotFoundError(
            f"{str(model_dir)!r} has a config.json but no weights (*.safetensors)"
        )
    if (
        not (model_dir / "tokenizer.json").is_file()
        and not (model_dir / "tokenizer_config.json").is_file()
    ):
        raise FileNotFoundError(f"{str(model_dir)!r} has no tokenizer (tokenizer.json)")
    return model_dir


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(check_model_dir(path), local_files_only=True)
    tokenizer.padding_side = "left"
    return tokenizer
