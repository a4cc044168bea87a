"""What the learner and the built-in engine compute, recorded once so that a change of
structure (issue 27: the learner package, one decode loop, typed configs) can show it
changed no behaviour: for fixed seeds, the same step metrics, the same trained
parameters and the same engine log-probs as the code before it.

    python tests/behaviour.py      # rewrites tests/fixtures/behaviour.json (only on purpose)

Everything starts from shipped bytes (the shipped `small` model, the recorded groups in
the fixture), so the values do not depend on the machine they were recorded on beyond
floating-point summation order, which the test's tolerances absorb.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "behaviour.json"
#: The learner settings recorded, each trained for every recorded step.
CONFIGS = {
    "decoupled_two_minibatches": ["correction=token_tis", "optim.mini_batches=2"],
    "mis_kl_two_epochs": ["correction=token_mis", "optim.kl_coef=0.05", "optim.ppo_epochs=2"],
    "fp8_quantized_forward": ["precision=fp8", "precision.learner_forward=quantized"],
}
#: The step metrics compared.
METRIC_KEYS = (
    "loss/policy",
    "loss/total",
    "loss/entropy",
    "optim/grad_norm",
    "mismatch/kl_k3",
    "reward/mean",
)
ENGINE_PRECISIONS = ("bf16", "fp8", "fp8_kv")
SEQUENCES = 6


def shipped_model() -> Path:
    """The model `make run` starts from, shipped in the package (bytes, not a warm start
    that depends on the CPU)."""
    from asyncfp8.models.tiny import shipped_on

    return shipped_on("small", "addition")


def train(model_dir: Path, groups, overrides: list[str], run_dir: Path):
    """(per-step metrics, {name: final FP32 parameter}) of the learner on `groups`."""
    from asyncfp8.learner import Learner
    from asyncfp8.run import distributed
    from tests.recorded import learner_config
    from tests.recorded import train as train_one

    learner = Learner(learner_config(model_dir, run_dir, *overrides))
    learner.version = 0
    try:
        metrics = [train_one(learner, step) for step in groups]
        full = distributed.full_state_dict(learner.model)  # FSDP2 shards: gathered whole
        params = {n: full[n].detach().float().clone() for n, _ in learner.model.named_parameters()}
    finally:
        learner.close()
    return metrics, params


def engine_logprobs(model_dir: Path, params: dict, precision: str, sequences) -> list[list[float]]:
    """The built-in engine's teacher-forced log-probs of `sequences` after applying the
    version `params` make in `precision` (KV scales calibrated on the sequences)."""
    from asyncfp8.engines.torch_engine import TorchEngine
    from asyncfp8.models import load_model
    from asyncfp8.precision import calibrate_version, get_policy, version_weights

    model = load_model(model_dir, dtype=torch.float32)
    model.load_state_dict(params, strict=False)
    policy = get_policy(precision)
    policy.bind_model(model.config)
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    extra = calibrate_version(model, policy, {"input_ids": ids, "attention_mask": mask})
    masters = [(n, p.detach()) for n, p in model.named_parameters()]
    engine = TorchEngine(str(model_dir), precision, device="cpu")
    engine.update_weights(0, dict(version_weights(policy, masters)), extra)
    return [row.float().tolist() for row in engine.score(sequences).logprobs]


def summary(params: dict, start: dict) -> dict[str, list[float]]:
    """Per parameter: (norm of the parameter, norm of its change from the start)."""
    return {
        name: [p.norm().item(), (p - start[name].float()).norm().item()]
        for name, p in params.items()
    }


def record() -> dict:
    from asyncfp8.models import load_model
    from tests.recorded import record_groups, save_groups

    model_dir = shipped_model()
    groups = record_groups(model_dir, steps=3, groups=4, group_size=4, seed=7)
    start = {
        n: p.detach() for n, p in load_model(model_dir, dtype=torch.float32).named_parameters()
    }
    flat = [t for step in groups for g in step for t in g.trajectories]
    sequences = [list(t.prompt_ids) + list(t.token_ids) for t in flat[:: len(flat) // SEQUENCES]]
    sequences = sequences[:SEQUENCES]
    out: dict = {"model": model_dir.name, "sequences": sequences, "configs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "groups.json"
        save_groups(groups, path)
        out["groups"] = json.loads(path.read_text())
        trained = {}
        for name, overrides in CONFIGS.items():
            metrics, params = train(model_dir, groups, overrides, Path(tmp) / name)
            trained[name] = params
            out["configs"][name] = {
                "overrides": overrides,
                "metrics": [{k: float(m[k]) for k in METRIC_KEYS if k in m} for m in metrics],
                "parameters": summary(params, start),
            }
    params = trained["decoupled_two_minibatches"]
    out["engine"] = {p: engine_logprobs(model_dir, params, p, sequences) for p in ENGINE_PRECISIONS}
    out["commit"] = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=FIXTURE.parent
    ).stdout.strip()
    return out


def groups_of(recorded: dict):
    from asyncfp8.sync import Trajectory
    from asyncfp8.train.batches import Group

    return [
        [
            Group(lease, prompt, [Trajectory(**t) for t in members])
            for lease, prompt, members in step
        ]
        for step in recorded["groups"]
    ]


if __name__ == "__main__":
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(record()))
    print(f"written {FIXTURE}")
