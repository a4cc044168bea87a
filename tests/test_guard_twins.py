"""scripts/guard_twins.py: each rollback of a guarded run judged by its twin without the
guard, on synthetic runs whose outcome the test sets."""

import importlib.util
from pathlib import Path

from omegaconf import OmegaConf

from asyncfp8.report.metrics import MetricsLog
from tests.test_collapse import compose

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("guard_twins", ROOT / "scripts" / "guard_twins.py")
guard_twins = importlib.util.module_from_spec(spec)
spec.loader.exec_module(guard_twins)

STEPS = 60


def write_run(path: Path, seed: int, rewards: list[float], rollbacks: dict[int, int] | None = None):
    """A finished run of len(rewards) steps; `rollbacks` {step: far tokens} marks the
    steps the guard rolled back (every other step's batch had no far token)."""
    rollbacks = rollbacks or {}
    path.mkdir(parents=True)
    # a far token or two fails a batch here (guard.far_tokens=1, the default before session 31)
    config = compose(f"run.seed={seed}", f"run.dir={path}", "guard.far_tokens=1")
    OmegaConf.save(config, path / "config.yaml")
    (path / "summary.json").write_text("{}")
    log = MetricsLog(path, tensorboard=False)
    evaluation = {"eval/pass1_sampled": 0.1, "eval/prompts": 128}
    log.write(0, {"version": 0, "eval/pass1_greedy": 0.3} | evaluation)
    for step, reward in enumerate(rewards, 1):
        record = {"reward/mean": reward, "time/elapsed_s": step, "total/samples": 64 * step}
        record |= {"guard/rolled_back": int(step in rollbacks)}
        record |= {"guard/far_tokens": rollbacks.get(step, 0), "guard/far_fraction": 0.0}
        if step == len(rewards):
            record |= {"eval/pass1_greedy": 0.9 if reward > 0.1 else 0.0} | evaluation
        log.write(step, record)
    log.close()


def test_each_rollback_is_needed_false_or_not_judged_by_its_twin(tmp_path, capsys):
    learned = [0.5 + 0.001 * i for i in range(STEPS)]
    dead = learned[:30] + [0.0] * (STEPS - 30)
    # seed 0: the twin learned on: the rollback at 20 undid a harmless step
    write_run(tmp_path / "on_seed0", 0, learned, {20: 1})
    write_run(tmp_path / "off_seed0", 0, learned)
    # seed 1: the twin died after step 30: the rollback at 30 was needed
    write_run(tmp_path / "on_seed1", 1, learned, {30: 40})
    write_run(tmp_path / "off_seed1", 1, dead)
    # seed 2: two rollbacks: the second comes after the first, whose undoing parted the
    # weights even where the batches still read the same
    write_run(tmp_path / "on_seed2", 2, learned, {10: 2, 12: 1})
    write_run(tmp_path / "off_seed2", 2, learned)
    # seed 3: a rollback after the batches themselves parted (another reward at step 5)
    parted = learned[:5] + [r + 0.01 for r in learned[5:]]
    write_run(tmp_path / "on_seed3", 3, parted, {40: 0})  # no far token: dead reward
    write_run(tmp_path / "off_seed3", 3, learned)
    table = guard_twins.main([str(tmp_path), "on:off", "--json", str(tmp_path / "t.json")])
    verdicts = {
        seed: [(r["step"], r["far_tokens"], r["verdict"]) for r in row["rollbacks"]]
        for seed, row in table["on:off"].items()
    }
    assert verdicts == {
        0: [(20, 1, "false")],
        1: [(30, 40, "needed")],
        2: [(10, 2, "false"), (12, 1, "not judged")],
        3: [(40, 0, "not judged")],
    }
    signals = [r["signal"] for row in table["on:off"].values() for r in row["rollbacks"]]
    assert signals == ["far_tokens", "far_tokens", "far_tokens", "far_tokens", "dead_reward"]
    assert table["on:off"][1]["far_token_batches"] == {"0": STEPS - 1, "40": 1}
    printed = capsys.readouterr().out
    assert "rollbacks: 1 needed, 2 false, 2 not judged" in printed
    assert "guarded batches by far tokens: 0: 236, 1: 2, 2: 1, 40: 1" in printed
