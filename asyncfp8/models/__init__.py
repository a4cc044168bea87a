"""Models: the tiny Qwen2 models this project makes and ships, which model a run uses, and
(from asyncfp8.hf) the loading of any HF model directory."""

from asyncfp8.hf.loading import check_model_dir, load_model, load_tokenizer

from .run_model import resolve_model_dir, run_model_dir

_TINY_NAMES = ("SIZES", "ModelSpec", "WarmStart", "make_tiny_model", "read_metadata")


def __getattr__(name: str):
    # Imported on first use, so `python -m asyncfp8.models.tiny` does not import the
    # module twice (once as a package member, once as __main__).
    if name in _TINY_NAMES:
        from . import tiny

        return getattr(tiny, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "check_model_dir",
    "load_model",
    "load_tokenizer",
    "resolve_model_dir",
    "run_model_dir",
    *_TINY_NAMES,
]
