"""Every config group is typed (asyncfp8/conf/schemas.py): a value of the wrong type, a
name outside a setting's choices, or a key that does not exist fails when the config
is composed, naming the key, before a socket is bound or a model loaded; every key has
its default and its help in the schema, and nowhere else."""

import dataclasses
import subprocess
import sys
import time
from importlib.resources import files

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from asyncfp8.conf.schemas import ENGINE_SCHEMAS, SCHEMAS


def composed(*overrides):
    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides))


def keys_of(schema, prefix=""):
    """{key: help} of every leaf of a settings dataclass."""
    out = {}
    instance = schema()
    for f in dataclasses.fields(schema):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            out |= keys_of(type(value), f"{prefix}{f.name}.")
        else:
            out[prefix + f.name] = f.metadata.get("help")
    return out


def leaf_keys(node, prefix=""):
    out = set()
    for key, value in node.items():
        if isinstance(value, dict):
            out |= leaf_keys(value, f"{prefix}{key}.")
        else:
            out.add(prefix + key)
    return out


@pytest.mark.parametrize(
    "group", [*SCHEMAS, *(f"engine/{name}" for name in ENGINE_SCHEMAS)], ids=str
)
def test_every_key_has_its_default_and_help_in_the_schema_alone(group):
    if group.startswith("engine/"):
        engine = group.split("/")[1]
        node = composed(f"engine={engine}").engine
        schema = ENGINE_SCHEMAS[engine]
        yaml = files("asyncfp8.conf") / "engine" / f"{engine}.yaml"
    else:
        node, schema = composed()[group], SCHEMAS[group]
        yaml = next((files("asyncfp8.conf") / group).iterdir())
    values = OmegaConf.to_container(node, resolve=False)
    helps = keys_of(schema)
    assert leaf_keys(values) == helps.keys()
    assert not OmegaConf.missing_keys(node)  # every key has a default
    assert all(helps.values()), [key for key, text in helps.items() if not text]
    # the group's YAML only points at the schema: a default is written once
    assert set(OmegaConf.load(yaml)) == {"defaults"}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sync.chunk_mb=big", "could not be converted to Float"),
        ("run.steps=ten", "could not be converted to Integer"),
        ("eval.every=1.5", "could not be converted to Integer"),
        ("optim.schedule=linear", "Invalid value 'linear', expected one of [constant, cosine]"),
        ("optim.kl_estimator=k2", "expected one of [k1, k3, low_var_kl]"),
        ("sync.transport=udp", "expected one of [auto, shm, tcp]"),
        ("run.compute_dtype=fp16", "expected one of [auto, float32, bfloat16, float16]"),
        ("run.device=tpu", "expected one of [auto, cpu, cuda]"),
        ("sync.probe.enabled=maybe", "is not a valid bool"),
        ("engine.slots=many", "could not be converted to Integer"),
        ("engine.speculative.ks=[a]", "could not be converted to Integer"),
        ("run.stepz=3", "Key 'stepz' not in 'RunConfig'"),
    ],
)
def test_a_wrong_value_fails_at_composition_naming_the_key(override, message):
    with pytest.raises(ConfigCompositionException) as caught:
        composed(override)
    cause = str(caught.value.__cause__)
    assert message in cause, cause
    key = override.split("=")[0]
    assert f"full_key: {key}" in cause or key.split(".")[-1] in cause


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        ("run.loggers=wandb", "run.loggers", "wandb"),  # one name, as report/metrics.py takes it
        ("engine.speculative.mode=false", "engine.speculative.mode", False),  # off
        ("engine.speculative.mode=null", "engine.speculative.mode", None),
        ("run.worker_id=3", "run.worker_id", "3"),  # what the launcher passes
        ("engine.device=cuda:1", "engine.device", "cuda:1"),
        ("sync.chunk_mb=0.5", "sync.chunk_mb", 0.5),
        ("optim.clip_ratio_c=null", "optim.clip_ratio_c", None),
    ],
)
def test_the_values_the_code_takes_still_compose(override, key, value):
    assert OmegaConf.select(composed(override), key) == value


def test_an_engine_typed_by_its_own_schema():
    cfg = composed("engine=vllm", "engine.kv_cache_gib=2")
    assert cfg.engine.kv_cache_gib == 2.0 and cfg.engine.get("slots") is None
    with pytest.raises(ConfigCompositionException):
        composed("engine=vllm", "engine.kv_cache_gib=lots")


@pytest.mark.slow
def test_the_launcher_refuses_a_wrong_type_within_seconds(tmp_path):
    # Found by hand before the schemas: this passed every check, started the learner,
    # loaded the model and died in it with "invalid literal for int()".
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "asyncfp8.launch", "sync.chunk_mb=big", f"run.dir={tmp_path}/r"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "full_key: sync.chunk_mb" in done.stdout + done.stderr
    assert time.monotonic() - started < 30
    assert not (tmp_path / "r").exists()  # nothing started


def test_the_configuration_reference_is_the_one_the_schemas_make():
    """docs/configuration.md is generated (python -m asyncfp8.conf.reference), never edited
    by hand: a setting added, renamed or re-documented in a schema shows here."""
    from pathlib import Path

    from asyncfp8.conf.reference import reference

    page = Path(__file__).parent.parent / "docs" / "configuration.md"
    assert page.read_text() == reference(), (
        "run: python -m asyncfp8.conf.reference > docs/configuration.md"
    )
    for key in ("`run.steps`", "`optim.lr`", "`guard.far_tokens`", "`correction.min_kept`"):
        assert key in page.read_text()


def test_every_setting_of_the_planner_says_what_it_does():
    """The planner's config keeps its defaults and their help in plan.yaml (the reference
    reads both): a key added without a comment would show with no help."""
    from asyncfp8.conf.reference import plan_rows

    rows = plan_rows()
    assert {"model.path", "gpu", "engine.kind", "sync.mode", "plan.precisions"} <= {
        key for key, _, _ in rows
    }
    assert [key for key, _, text in rows if not text] == []
