"""Where a weight format lives (docs/precision.md, "What a new format writes"), the
layering the formats keep, and which engine refuses what (each adapter's `supports`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from transformers import AutoConfig

from asyncfp8.engines import supports
from asyncfp8.precision import get_policy, registered_policies
from asyncfp8.precision.registry import _POLICIES
from tests.user_policies import NoRuntimeModule

PACKAGE = Path(__file__).resolve().parents[1] / "asyncfp8"


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at module level or inside functions, made absolute."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if path.name == "__init__.py":
        package += ".__init__"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level)[0] + "." if node.level else ""
            found.add(base + (node.module or ""))
    return found


def test_precision_never_imports_the_engines():
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            m for m in imported_modules(path) if m.startswith("asyncfp8.engines")
        )
        for path in (PACKAGE / "precision").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    # The scan sees imports inside functions too (a positive control).
    assert "asyncfp8.precision.fp8.gemm" in imported_modules(PACKAGE / "precision/fp8/linear.py")


@pytest.mark.parametrize("name", registered_policies())
def test_each_built_in_format_is_one_file_or_folder_plus_one_yaml(name):
    module = _POLICIES[name].__module__
    assert module == f"asyncfp8.precision.{name}"
    place = PACKAGE / "precision" / name
    assert place.is_dir() or place.with_suffix(".py").is_file()
    assert (PACKAGE / "conf" / "precision" / f"{name}.yaml").is_file()
    if place.is_dir():  # nothing of the format lives outside its folder
        outside = {
            m
            for path in PACKAGE.rglob("*.py")
            if place not in path.parents
            for m in imported_modules(path)
            if m.startswith(f"{module}.")
        }
        allowed = {
            f"{module}.attention",
            f"{module}.quant",
        }  # the engine's attention; shared e4m3 constants
        assert outside <= allowed, outside - allowed


@pytest.fixture(scope="module")
def tiny_config(tiny_model_dir):
    return AutoConfig.from_pretrained(tiny_model_dir, local_files_only=True)


@pytest.mark.parametrize(
    ("engine", "precision", "params", "reason"),
    [
        ("torch", "fp8", {"block_size": [64, 32]}, None),
        (
            "vllm",
            "fp8",
            {"block_size": [64, 64]},
            r"128x128 weight blocks; precision.block_size=\[64, 64\]",
        ),
        ("vllm", "fp8", {}, r"whole 128x128 blocks, and this model's intermediate_size = "),
        ("vllm", "int8", {}, None),
        ("vllm", "fp8_kv", {}, None),
        ("vllm", "bf16", {"lm_head_fp32": True}, "no option to run the LM head in FP32"),
        ("sglang", "int8", {}, "update_weights_from_tensor re-runs no post-load processing"),
        ("sglang", "bf16", {}, None),
        ("torch", "bf16", {"lm_head_fp32": True}, None),
    ],
)
def test_each_adapter_says_what_it_cannot_run(engine, precision, params, reason, tiny_config):
    policy = get_policy(precision, **params)
    policy.bind_model(tiny_config)
    said = supports(engine, policy)
    if reason is None:
        assert said is None
    else:
        assert said is not None and __import__("re").search(reason, said), said


def test_the_torch_engine_needs_a_runtime_module_and_unknown_engines_are_named():
    assert "no runtime module" in supports("torch", NoRuntimeModule())
    with pytest.raises(ValueError, match="unknown engine 'trt'; available: torch, vllm, sglang"):
        supports("trt", get_policy("bf16"))
