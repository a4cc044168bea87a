"""The typed manifest of a version: every tensor's role and layer, set by the policy,
carried by the header, and the one check of a received version every engine runs."""

from __future__ import annotations

import pytest
import torch

from asyncfp8.engines.torch_engine import TorchEngine
from asyncfp8.models import load_model
from asyncfp8.precision import (
    Role,
    TensorRole,
    TensorSpec,
    check_received,
    get_policy,
    version_tensors,
)
from asyncfp8.precision.fp8_kv import kv_scale_names
from asyncfp8.sync.codec import encode_version
from asyncfp8.sync.limits import RejectedMessage
from asyncfp8.sync.version_decode import decode_version


def calibration(tokens: int = 12) -> dict[str, torch.Tensor]:
    ids = torch.arange(1, tokens + 1)[None].repeat(2, 1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_the_policy_sets_each_tensors_role_and_layer(tiny_model_dir):
    model = load_model(tiny_model_dir, dtype=torch.float32)
    version = version_tensors(model, get_policy("fp8+fp8_kv"), calibration())
    weights = dict(version.weights)  # the roles of the weights fill in as they stream
    roles = version.roles
    assert set(roles) == set(weights) | set(version.extra)
    layers = model.config.num_hidden_layers
    name = "model.layers.1.self_attn.q_proj.weight"
    assert roles[name] == TensorRole(Role.WEIGHT, 1)
    assert roles[name + "_scale_inv"] == TensorRole(Role.WEIGHT_SCALE, 1)
    assert roles["model.embed_tokens.weight"] == TensorRole(Role.WEIGHT, None)
    assert roles["model.layers.0.input_layernorm.weight"] == TensorRole(Role.WEIGHT, 0)
    for layer in range(layers):
        for part, kv_name in kv_scale_names(layer).items():
            assert roles[kv_name] == TensorRole(Role.KV_SCALE, layer, part)
    scales = [n for n, r in roles.items() if r.role is Role.WEIGHT_SCALE]
    assert len(scales) == 7 * layers  # q, k, v, o, gate, up, down per layer


def test_roles_travel_in_the_header_and_come_out_as_the_manifest(tiny_model_dir):
    model = load_model(tiny_model_dir, dtype=torch.float32)
    version = version_tensors(model, get_policy("int8+fp8_kv"), calibration())
    weights = list(version.weights)
    received = decode_version(encode_version(3, weights, version.extra, roles=version.roles))
    assert received.manifest == version.roles
    assert set(received.weights) == {n for n, _ in weights}
    assert set(received.extra) == set(version.extra)
    # A tensor sent without a role is a plain weight (or an unspecified extra tensor).
    plain = decode_version(encode_version(4, weights[:1], {"x": torch.ones(())}))
    assert plain.manifest == {
        weights[0][0]: TensorRole(Role.WEIGHT),
        "x": TensorRole(Role.EXTRA),
    }


def test_a_role_in_the_wrong_section_is_refused_at_the_sender():
    kv = TensorRole(Role.KV_SCALE, 0, "k")
    with pytest.raises(ValueError, match="kv_scale tensor sent as weights"):
        encode_version(0, [("w", torch.ones(2))], roles={"w": kv})


@pytest.mark.parametrize(
    "entry",
    [
        {"role": "bias"},
        {"role": "kv_scale", "layer": 0, "kv_part": "x"},
        {"role": "kv_scale", "layer": None, "kv_part": "k"},
        {"role": "weight", "layer": -1},
        {"role": "weight", "layer": "1"},
        {"role": "weight", "kv_part": "q"},
    ],
)
def test_a_malformed_role_in_a_header_is_rejected(entry):
    from asyncfp8.sync.codec import entry_role

    with pytest.raises(RejectedMessage):
        entry_role({"name": "t", **entry})


SPECS = {
    "w": TensorSpec((2, 3), torch.bfloat16, TensorRole(Role.WEIGHT, 0)),
    "w_scale": TensorSpec((1, 1), torch.float32, TensorRole(Role.WEIGHT_SCALE, 0)),
    "k": TensorSpec((), torch.float32, TensorRole(Role.KV_SCALE, 0, "k")),
}
WHOLE = {"w": torch.zeros(2, 3, dtype=torch.bfloat16), "w_scale": torch.ones(1, 1)}


def test_the_check_returns_each_tensors_role_with_or_without_a_manifest():
    sent = {**WHOLE, "k": torch.tensor(0.5)}
    assert check_received(1, sent.items(), None, SPECS) == {n: SPECS[n].role for n in sent}
    manifest = {n: SPECS[n].role for n in sent}
    assert check_received(1, sent.items(), manifest, SPECS) == manifest
    # Extra tensors alone (no weights) are a version too: KV scales only.
    assert check_received(2, [("k", torch.tensor([0.25]))], None, SPECS)["k"].part == "k"


@pytest.mark.parametrize(
    ("tensors", "manifest", "message"),
    [
        ({**WHOLE, "z": torch.ones(1)}, None, "unknown tensor 'z'"),
        ({"w": WHOLE["w"]}, None, "lacks 1 of the engine's weights"),
        ({**WHOLE, "w": torch.zeros(3, 2, dtype=torch.bfloat16)}, None, r"w is \(3, 2\)"),
        ({**WHOLE, "w_scale": torch.ones(1, 1, dtype=torch.bfloat16)}, None, "w_scale is"),
        ({"k": torch.tensor(0.0)}, None, "finite and > 0"),
        ({"k": torch.tensor(float("nan"))}, None, "finite and > 0"),
        ({"k": torch.ones(2)}, None, "one floating-point value"),
        (WHOLE, {"w": TensorRole(Role.WEIGHT, 0)}, "w_scale has no role"),
        (
            WHOLE,
            {"w": TensorRole(Role.WEIGHT, 1), "w_scale": TensorRole(Role.WEIGHT_SCALE, 0)},
            "w is sent as",
        ),
    ],
)
def test_the_check_refuses_a_version_that_does_not_fit(tensors, manifest, message):
    with pytest.raises(ValueError, match=message):
        check_received(7, tensors.items(), manifest, SPECS)


def test_an_adapter_without_roles_takes_either_weight_role_and_no_other():
    specs = {"w": TensorSpec((2,), torch.float32)}  # a checkpoint's tensor: role unknown
    w = [("w", torch.ones(2))]
    for role in (Role.WEIGHT, Role.WEIGHT_SCALE):
        check_received(0, w, {"w": TensorRole(role)}, specs)
    with pytest.raises(ValueError, match="this engine holds it as a weight"):
        check_received(0, w, {"w": TensorRole(Role.EXTRA)}, specs)


def test_the_torch_engine_reads_a_kv_scales_layer_from_the_manifest(tiny_model_dir):
    model = load_model(tiny_model_dir, dtype=torch.float32)
    policy = get_policy("fp8_kv")
    version = version_tensors(model, policy, calibration())
    weights = dict(version.weights)
    engine = TorchEngine(str(tiny_model_dir), "fp8_kv", device="cpu")
    engine.update_weights(0, weights, version.extra, version.roles)
    k1 = kv_scale_names(1)["k"]
    assert float(engine.kv_scales[1][0]) == float(version.extra[k1])
    # The same tensors with two roles swapped in the manifest: refused, nothing written.
    k0 = kv_scale_names(0)["k"]
    swapped = dict(version.roles) | {k0: version.roles[k1], k1: version.roles[k0]}
    doubled = {n: t * 2 for n, t in version.extra.items()}
    with pytest.raises(ValueError, match="is sent as"):
        engine.update_weights(1, weights, doubled, swapped)
    assert float(engine.kv_scales[1][0]) == float(version.extra[k1]) and engine.version == 0


def test_roles_filled_while_the_weights_stream_reach_the_header(tiny_model_dir):
    # fp8 calibrates nothing: the roles dict is empty when the encoder starts and fills
    # as `weights` streams; the encoder must read that dict, not a fresh one.
    model = load_model(tiny_model_dir, dtype=torch.float32)
    version = version_tensors(model, get_policy("fp8"), calibration())
    assert version.roles == {}
    received = decode_version(
        encode_version(0, version.weights, version.extra, roles=version.roles)
    )
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    assert received.manifest[name] == TensorRole(Role.WEIGHT_SCALE, 1)


def test_weights_sent_without_roles_fit_an_engine_that_knows_theirs():
    # A publisher that sends no roles (bench/sync.py, docs/sync.md): each is a weight.
    manifest = {n: TensorRole(Role.WEIGHT) for n in WHOLE}
    assert check_received(0, WHOLE.items(), manifest, SPECS) == {n: SPECS[n].role for n in WHOLE}
    with pytest.raises(ValueError, match="extra_roles"):
        check_received(0, [("k", torch.tensor(0.5))], {"k": TensorRole(Role.EXTRA)}, SPECS)
    with pytest.raises(ValueError, match="k is sent as"):
        check_received(0, [("k", torch.tensor(0.5))], {"k": TensorRole(Role.WEIGHT)}, SPECS)


@pytest.mark.parametrize("role", [["weight"], {"a": 1}, 3])
def test_an_unhashable_or_odd_role_is_rejected_not_raised(role):
    from asyncfp8.sync.codec import entry_role

    with pytest.raises(RejectedMessage):
        entry_role({"name": "t", "role": role})
