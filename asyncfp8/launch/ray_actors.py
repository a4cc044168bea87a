"""The cluster side of a run on Ray: the connection, what each actor asks of the cluster
(refused before anything starts where it cannot be given), the CURVE keys each actor
receives, and `RayProcess`, the actor that holds one learner rank's or worker's process on
its node (docs/clusters.md#on-a-ray-cluster)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from asyncfp8.launch.processes import CONFIG_ERROR, PORTS, Process, free_ports
from asyncfp8.run.files import CHECKPOINT_DIR, LEARNER_STATE
from asyncfp8.sync.security import CLIENT, CLIENTS_DIR, SERVER

RAY_INSTALL = 'pip install -c constraints.txt -e ".[ray]"'
CONNECT_TIMEOUT = 5.0  # s to reach the cluster's address before refusing
# s between an actor's checks that the cluster still counts its node alive (RayProcess.fence)
FENCE_EVERY = 2.0


def import_ray(address_named: str):
    """Ray, or a refusal naming the setting that asked for it."""
    try:
        import ray
    except ImportError:
        raise ValueError(
            f"run.ray=true ({address_named}) but Ray is not installed: {RAY_INSTALL}"
        ) from None
    return ray


def cluster_address(run: DictConfig, environ: dict[str, str]) -> tuple[str, str]:
    """(the address, which setting named it): run.ray_address, else RAY_ADDRESS, else auto."""
    if run.ray_address:
        return str(run.ray_address), f"run.ray_address={run.ray_address}"
    if environ.get("RAY_ADDRESS"):
        return environ["RAY_ADDRESS"], f"RAY_ADDRESS={environ['RAY_ADDRESS']}"
    return "auto", "run.ray_address=null and no RAY_ADDRESS: auto"


def reachable(address: str, named: str) -> None:
    """A host:port address must answer within seconds: Ray's own connect retries for a
    minute or more before it gives up on an address where nothing listens."""
    if address == "auto" or address.startswith("local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT).close()
    except (OSError, ValueError) as err:
        raise ValueError(
            f"run.ray=true: no Ray cluster at {address} ({named}): {err}. Start one "
            "(`ray start --head`) or point run.ray_address / RAY_ADDRESS at it"
        ) from None


def connect(run: DictConfig, environ: dict[str, str]):
    """Ray, connected to the running cluster (never a new local one), or a refusal."""
    address, named = cluster_address(run, environ)
    ray = import_ray(named)
    reachable(address, named)
    try:
        ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as err:
        raise ValueError(
            f"run.ray=true: cannot connect to a Ray cluster ({named}): {err}"
        ) from None
    return ray


def bundle(spec: DictConfig) -> dict[str, float]:
    """One rank's or one worker's resources, as Ray's placement bundles spell them."""
    wanted = {"CPU": float(spec.num_cpus), "GPU": float(spec.num_gpus)}
    wanted.update({str(k): float(v) for k, v in (spec.resources or {}).items()})
    return {name: amount for name, amount in wanted.items() if amount > 0}


def shortfall(
    learner: dict[str, float],
    ranks: int,
    worker: dict[str, float],
    workers: int,
    free: dict[str, float],
    total: dict[str, float],
) -> str | None:
    """What the run asks for and the cluster has not free, in words; None when it fits."""
    missing = []
    for name in sorted(set(learner) | set(worker)):
        asked = learner.get(name, 0) * ranks + worker.get(name, 0) * workers
        if asked > free.get(name, 0) + 1e-9:
            missing.append(
                f"{asked:g} {name} ({ranks} learner rank(s) x {learner.get(name, 0):g} + "
                f"{workers} worker(s) x {worker.get(name, 0):g}) but {free.get(name, 0):g} "
                f"free ({total.get(name, 0):g} in the cluster)"
            )
    if not missing:
        return None
    return (
        "run.ray=true: the run asks for " + "; ".join(missing) + ". Lower run.ray_learner / "
        "run.ray_worker, run.learner_procs or run.workers, or add nodes"
    )


def curve_keys(cfg: DictConfig) -> dict[str, dict[str, bytes]] | None:
    """The CURVE key files each role needs, read here once: they reach the actors as
    arguments, never through a shared directory anyone else could read."""
    if not cfg.sync.curve.enabled:
        return None
    keys = Path(cfg.sync.curve.keys_dir)
    clients = {f"{CLIENTS_DIR}/{p.name}": p.read_bytes() for p in (keys / CLIENTS_DIR).glob("*")}

    def read(*names: str) -> dict[str, bytes]:
        return {name: (keys / name).read_bytes() for name in names}

    return {
        "learner": {**read(f"{SERVER}.key", f"{SERVER}.key_secret"), **clients},
        "worker": read(f"{CLIENT}.key", f"{CLIENT}.key_secret", f"{SERVER}.key"),
    }


class RayProcess:
    """A Ray actor that holds one asyncfp8 process on its node. Every method runs on the
    actor's one thread, where the process was started: Linux sends the process SIGTERM
    when the thread that started it goes (asyncfp8.run.process.die_with_parent)."""

    def __init__(
        self,
        name: str,
        module: str,
        args: list[str],
        run_dir: str,
        keys: dict[str, bytes] | None = None,
        learner_node: str | None = None,
    ):
        import ray

        self.node = ray.get_runtime_context().get_node_id()
        self.ip = ray.util.get_node_ip_address()
        self.keys_dir = None
        args = list(args)
        if keys is not None:
            self.keys_dir = private_keys_dir(keys)
            args.append(f"sync.curve.keys_dir={self.keys_dir}")
        if learner_node is not None and learner_node != self.node:
            args.append("sync.transport=tcp")  # shared memory reaches this node only
        self.process = Process(name, module, args, Path(run_dir))
        if module == "asyncfp8.worker":  # a restarted actor starts its worker again
            self.process.start()
        threading.Thread(target=self.fence, args=(ray,), daemon=True).start()

    def fence(self, ray) -> None:
        """Ends this actor and its process once the cluster has declared its node dead. Ray
        starts another copy elsewhere, but a node that only lost touch keeps its processes
        running and, when it comes back, Ray may take over a minute to end them: two copies
        of a worker, or a learner writing checkpoints beside its resumed self."""
        while True:
            time.sleep(FENCE_EVERY)
            with contextlib.suppress(Exception):  # no answer from the GCS: ask again
                nodes = ray.nodes()
                if any(n["NodeID"] == self.node and not n["Alive"] for n in nodes):
                    self.process.signal(signal.SIGKILL)
                    self.cleanup()
                    os._exit(1)

    def where(self) -> dict[str, Any]:
        """This node: its id, IP, and ports free on it now (rank 0 binds them next)."""
        return {"node": self.node, "ip": self.ip, "ports": free_ports(len(PORTS) + 1)}

    def start(self, extra: list[str], env: dict[str, str]) -> None:
        """Starts the learner rank, once rank 0's node has given the addresses."""
        self.process.overrides = [*self.process.overrides, *extra]
        self.process.env = {**os.environ, **env}
        self.process.start()

    def poll(self) -> tuple[int | None, int]:
        """(the process's exit code, None while it runs; this actor's pid, which tells a
        restarted actor from the one before). A worker that failed takes its actor with
        it, so that Ray restarts the actor, on another node if need be."""
        code = self.process.poll()
        if self.process.module == "asyncfp8.worker" and code not in (None, 0, CONFIG_ERROR):
            self.cleanup()
            os._exit(1)
        return code, os.getpid()

    def wait(self, timeout: float) -> int | None:
        """The process's exit code once it exits within `timeout` s, else None."""
        return self.process.wait(timeout)

    def stop(self, grace: float) -> int | None:
        self.process.signal(signal.SIGTERM)
        code = self.process.wait(grace)
        if code is None:
            self.process.signal(signal.SIGKILL)
            code = self.process.wait(5)
        self.cleanup()
        return code

    def cleanup(self) -> None:
        if self.keys_dir:
            shutil.rmtree(self.keys_dir, ignore_errors=True)


def private_keys_dir(keys: dict[str, bytes]) -> str:
    """The key files in a fresh directory only this user can read (mkdtemp: mode 0700)."""
    directory = Path(tempfile.mkdtemp(prefix="asyncfp8-curve-"))
    (directory / CLIENTS_DIR).mkdir(mode=0o700)
    for name, data in keys.items():
        path = directory / name
        path.write_bytes(data)
        path.chmod(0o600)
    return str(directory)


def has_checkpoint(run_dir: Path) -> bool:
    return any((run_dir / CHECKPOINT_DIR).glob(f"step_*/{LEARNER_STATE}"))


def actor_options(spec: DictConfig) -> dict[str, Any]:
    """Ray's actor options for one rank or worker: what its bundle holds."""
    wanted = bundle(spec)
    return {
        "num_cpus": wanted.pop("CPU", 0),
        "num_gpus": wanted.pop("GPU", 0),
        "resources": wanted,
    }
