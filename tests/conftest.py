import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# The suite's time budget and the fast limit (tests/budget.py); the suite split over two
# pytest processes (tests/parallel.py); pytester for test_parallel's small suite.
pytest_plugins = ["tests.budget", "tests.parallel", "pytester"]

# vLLM on CPU: reach the engine in-process, cap its KV cache, do not pin threads
# (DESIGN.md §5). Set before any test imports vllm.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)
    # Each pytest process draws its runs' ports from a range of its own: two processes
    # could otherwise pick one port in the seconds between a check and a learner's bind.
    worker = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw") or 0)
    share = (32768 - 12000) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    low = 12000 + worker * share
    os.environ.setdefault("ASYNCFP8_PORT_RANGE", f"{low}-{low + share - 1}")


@pytest.fixture(scope="session")
def vllm_module():
    """vllm, or a skip; CI sets ASYNCFP8_REQUIRE_VLLM=1 so that a missing vllm fails."""
    if os.environ.get("ASYNCFP8_REQUIRE_VLLM") == "1":
        import vllm

        return vllm
    return pytest.importorskip("vllm", reason="the vllm extra is not installed")


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny-tensor tests: on 2 shared cores a second
    OpenMP thread costs far more than it gives."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    """The shipped tiny_moe model (Qwen3-MoE, 4 experts, top-2), copied so that no test
    changes the shipped one."""
    from asyncfp8.models import make_tiny_model
    from asyncfp8.models.tiny import SHIPPED_DIR

    shipped = make_tiny_model("tiny_moe", progress=False)
    assert shipped.parent == SHIPPED_DIR, f"no shipped tiny_moe model: {shipped} was built"
    out = tmp_path_factory.mktemp("moe") / "tiny_moe"
    shutil.copytree(shipped, out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny model warm-started on the default `arithmetic` task, shipped with the
    package (the same bytes on every CPU), copied once per test session so that no test
    can change the shipped one. Under pytest-xdist both processes ask for it in the
    directory they share; each copies beside it and renames, and the second finds the
    first's copy."""
    from asyncfp8.models import make_tiny_model
    from asyncfp8.models.tiny import SHIPPED_DIR

    shipped = make_tiny_model("tiny", progress=False)
    assert shipped.parent == SHIPPED_DIR, f"no shipped tiny model: {shipped} was built"
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, above each process's own
    out = root / "shared-models" / "tiny"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tiny.", dir=out.parent))
        shutil.copytree(shipped, staging, dirs_exist_ok=True)
        try:
            staging.rename(out)
        except OSError:  # the other process's copy got there first
            shutil.rmtree(staging)
    return out


def pytest_collection_modifyitems(config, items):
    """The tests that start vLLM in this process run first. vLLM's CPU platform, when an
    engine starts, scans every loaded module for kernels to override and trips over
    llvmlite's FFI wrapper (`'_lib_fn_wrapper' object has no attribute 'get'`); llvmlite is
    loaded with numba by the first weight delta (asyncfp8.sync.delta) or the first version
    copied through shared memory (asyncfp8.sync.copyhash). A worker starts its
    engine before it decodes any delta, so only a test session mixing both meets this
    (tests/parallel.py keeps it so when `make test` splits the suite over two processes)."""
    items.sort(key=lambda item: item.get_closest_marker("vllm") is None)


@pytest.fixture(scope="session")
def taught_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model taught to answer tests/taught.py's prompts with completions of
    known, different lengths (the same on every CPU; a few seconds)."""
    from tests.taught import teach

    return teach(tiny_model_dir, tmp_path_factory.mktemp("models") / "taught")


# The job in turns (run.mode=sync) that worker processes run and the colocated engine
# must match: one lease of the step's 4 groups at a time, as the colocated engine leases
# them, so the lease's seed and version, not the process that takes it, fix the samples.
TURNS = ("run.mode=sync", "run.steps=4", "run.lease_groups=4", "eval.every=0")


@pytest.fixture(scope="session")
def separate_turns(tiny_model_dir, tmp_path_factory):
    """(run dir, launcher output) of TURNS with two worker processes, launched once per
    session: test_e2e checks that sync mode trains only on the current version on it, and
    test_colocated that the colocated engine makes the same samples and steps."""
    from tests.launched import launch

    return launch(tmp_path_factory.mktemp("separate"), tiny_model_dir, *TURNS, "run.workers=2")


# The vLLM job in turns that a worker process runs and the colocated engine must match:
# one lease of the step's 4 groups at a time, as the colocated engine leases them.
VLLM_TURNS = (
    "run.mode=sync",
    "run.steps=4",
    "run.workers=1",
    "run.lease_groups=4",
    "engine=vllm",
)


@pytest.fixture(scope="session")
def vllm_worker_turns(tiny_model_dir, vllm_module, tmp_path_factory):
    """(run dir, launcher output) of VLLM_TURNS with a vLLM worker process, launched once
    per session (about 30 s): test_e2e checks the vLLM worker's run on it, and
    test_colocated compares the colocated vLLM engine with it."""
    from tests.launched import launch

    return launch(tmp_path_factory.mktemp("vllm_worker"), tiny_model_dir, *VLLM_TURNS, timeout=500)


@pytest.fixture
def armed(monkeypatch):
    """Arms fail points in this process as ASYNCFP8_FAILPOINTS would at import."""
    from asyncfp8.run import failpoints

    def arm(spec: str) -> None:
        monkeypatch.setattr(failpoints, "_armed", failpoints.parse(spec))
        monkeypatch.setattr(failpoints, "_hits", failpoints.Counter())

    return arm


@pytest.fixture(scope="module")
def recorded(tiny_model_dir):
    """Groups the tiny model sampled, three steps of 4 groups of 4 (a module may record its
    own under this name), for learners trained in this process (tests/recorded.py)."""
    from tests.recorded import record_groups

    return record_groups(tiny_model_dir, steps=3, groups=4, group_size=4)


@pytest.fixture
def make_learner(tmp_path, tiny_model_dir):
    """make(*overrides): an in-process learner on the tiny model, at version 0, in a run
    directory of its own; every one made is closed after the test."""
    from asyncfp8.learner import Learner
    from tests.recorded import learner_config

    made = []

    def make(*overrides):
        learner = Learner(learner_config(tiny_model_dir, tmp_path / f"run{len(made)}", *overrides))
        learner.version = 0
        made.append(learner)
        return learner

    yield make
    for learner in made:
        learner.close()


# test_e2e's reporting run, FP8 weights and an FP8 KV cache: also the run that
# test_wandb_logger reads its W&B offline run from, where wandb is installed.
REPORTING_STEPS = 8
REPORTING_RUN = (
    f"run.steps={REPORTING_STEPS}",
    "run.max_staleness=1",
    "run.workers=2",
    "run.export_every=4",
    "precision=fp8+fp8_kv",  # the torch engine's FP8 weights and FP8 KV cache
)


def wandb_offline_env(home) -> dict[str, str]:
    """W&B offline, its caches and settings under `home`, no key anywhere: nothing reaches
    the network or the home directory."""
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "NETRC": str(home / "netrc")}
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        env[name] = str(home / name.lower())
    return env


@pytest.fixture(scope="session")
def reporting_run(tiny_model_dir, tmp_path_factory):
    """(run dir, launcher output, whether W&B logged it) of REPORTING_RUN, launched once
    per session (about 30 s, W&B's service included): test_e2e checks its run, report,
    plots and export, and test_wandb_logger its W&B offline run (one launch, not two)."""
    import importlib.util

    from tests.launched import launch

    root = tmp_path_factory.mktemp("reporting")
    logged = importlib.util.find_spec("wandb") is not None
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    loggers = ()
    if logged:
        env |= wandb_offline_env(root / "wandb-home")
        loggers = ("run.loggers=[jsonl,wandb]",)
    run_dir, out = launch(root, tiny_model_dir, *REPORTING_RUN, *loggers, env=env)
    return run_dir, out, logged


# A user's precision policy (tests/user_policies.py: INT8 with its first layer in BF16),
# importable by every process a run starts, as a user's package would be.
USER_POLICY = ("precision._target_=user_policies.INT8EdgesBF16", "precision.keep_last=0")
USER_POLICY_SPEC = "user_policies.INT8EdgesBF16:int8_edges_bf16(keep_first=1, keep_last=0)"
USER_MODULES = [str(Path(__file__).parent), str(Path(__file__).parent.parent / "examples")]


def user_modules_env() -> dict[str, str]:
    path = [*USER_MODULES, *filter(None, [os.environ.get("PYTHONPATH")])]
    return os.environ | {"PYTHONPATH": os.pathsep.join(path)}


@pytest.fixture(scope="session")
def vllm_user_policy_run(tiny_model_dir, vllm_module, tmp_path_factory):
    """(run dir, launcher output) of 3 overlapped steps with a vLLM worker and the user's
    INT8 policy, launched once per session: test_e2e checks vLLM's INT8 run overlapped on
    it, test_user_policy that vLLM ran the user's policy."""
    from tests.launched import launch

    return launch(
        tmp_path_factory.mktemp("vllm_user_policy"),
        tiny_model_dir,
        *USER_POLICY,
        "engine=vllm",
        "run.steps=3",
        "run.workers=1",
        env=user_modules_env(),
        timeout=500,
    )


@pytest.fixture(scope="session")
def chat_dataset_run(tiny_model_dir, tmp_path_factory):
    """(run dir, launcher output) of 3 steps on a chat dataset (`task=dataset`, 64 rows of
    messages) with the torch engine and the user's policy, placed as `make run` places a
    run on one device (colocated, overlapped), launched once per session:
    test_dataset_task checks the chat template's use on it, test_user_policy the policy."""
    from tests.launched import launch

    root = tmp_path_factory.mktemp("chat_dataset")
    data = root / "chat.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
            )
            + "\n"
            for a in range(8)
            for b in range(8)
        )
    )
    return launch(
        root,
        tiny_model_dir,
        "task=dataset",
        f"task.path={data}",
        *USER_POLICY,
        "run.steps=3",
        "eval.every=3",
        "eval.prompts=4",
        env=user_modules_env(),
    )
