"""A Slurm cluster on this machine, as Debian packages it: `munged`, `slurmctld` and one
`slurmd`, each started here in the foreground with a configuration, a key, sockets,
state and logs in a directory of their own (nothing under /etc or /run is touched).
Needs root and `apt-get install slurmctld slurmd slurm-client munge`.

    with SlurmDaemons(tmp_path, cpus=4) as slurm:
        subprocess.run(["sbatch", ...], env=slurm.env)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from asyncfp8.launch.processes import free_ports

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue")


def unavailable() -> str | None:
    """Why Slurm cannot be started here (None when it can): what a test skips with."""
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return (
            f"{', '.join(missing)} not installed "
            "(apt-get install slurmctld slurmd slurm-client munge)"
        )
    if os.geteuid() != 0:
        return "the Slurm daemons run as root here"
    return None


def slurm_conf(directory: Path, node: str, cpus: int, ports: list[int]) -> str:
    """One node, one partition; processes tracked by /proc (no cgroups in a container),
    no accounting database."""
    return "\n".join(
        [
            "ClusterName=asyncfp8test",
            f"SlurmctldHost={node}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={ports[0]}",
            f"SlurmdPort={ports[1]}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={directory}/munge.socket",
            "CredType=cred/munge",
            f"StateSaveLocation={directory}/state",
            f"SlurmdSpoolDir={directory}/spool",
            f"SlurmctldPidFile={directory}/slurmctld.pid",
            f"SlurmdPidFile={directory}/slurmd.pid",
            f"SlurmctldLogFile={directory}/slurmctld.log",
            f"SlurmdLogFile={directory}/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            # more CPUs than this machine has: the tasks are small, and Slurm would
            # otherwise refuse the node's configuration
            "SlurmdParameters=config_overrides",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
            f"PartitionName=main Nodes={node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


class SlurmDaemons:
    def __init__(self, directory: Path, cpus: int = 4):
        self.directory = Path(directory)
        self.node = socket.gethostname()
        self.cpus = cpus
        self.processes: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.directory / "slurm.conf")}

    def __enter__(self) -> SlurmDaemons:
        d = self.directory
        for sub in ("state", "spool"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        d.chmod(0o755)  # munged refuses a socket directory others may write to
        key = d / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        (d / "slurm.conf").write_text(slurm_conf(d, self.node, self.cpus, free_ports(2)))
        try:
            self._start(
                "munged",
                "-F",
                "--force",
                f"--socket={d}/munge.socket",
                f"--key-file={key}",
                f"--pid-file={d}/munged.pid",
                f"--log-file={d}/munged.log",
                f"--seed-file={d}/munged.seed",
            )
            self._wait_for(lambda: (d / "munge.socket").exists(), "munged's socket")
            self._start("slurmctld", "-D", "-f", str(d / "slurm.conf"))
            self._start("slurmd", "-D", "-f", str(d / "slurm.conf"))
            self._wait_for(self._node_idle, f"node {self.node} idle in slurmctld")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self, *argv: str) -> None:
        log = (self.directory / f"{argv[0]}.out").open("a")
        self.processes.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        )
        log.close()

    def _node_idle(self) -> bool:
        done = subprocess.run(
            ["scontrol", "show", "node", self.node], env=self.env, capture_output=True, text=True
        )
        return "State=IDLE" in done.stdout

    def _no_jobs(self) -> bool:
        done = subprocess.run(
            ["squeue", "--noheader"], env=self.env, capture_output=True, text=True
        )
        return done.returncode == 0 and not done.stdout.strip()

    def _wait_for(self, condition, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if any(p.poll() is not None for p in self.processes):
                raise RuntimeError(f"a Slurm daemon exited waiting for {what}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout} s:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
            for p in sorted(self.directory.glob("*.out")) + sorted(self.directory.glob("*.log"))
        )

    def job_state(self, job_id: str) -> str:
        done = subprocess.run(
            ["scontrol", "show", "job", job_id], env=self.env, capture_output=True, text=True
        )
        for field in done.stdout.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def close(self) -> None:
        """Every job of this cluster cancelled (slurmstepd runs apart from slurmd and
        would outlive it), then the daemons stopped."""
        if len(self.processes) == len(("munged", "slurmctld", "slurmd")):
            subprocess.run(
                ["scancel", "--full", "--signal=KILL", f"--user={os.getuid()}"],
                env=self.env,
                capture_output=True,
            )
            subprocess.run(["scancel", f"--user={os.getuid()}"], env=self.env, capture_output=True)
            self._wait_for(self._no_jobs, "the cancelled jobs to end", timeout=30)
        for process in reversed(self.processes):  # slurmd, slurmctld, then munged
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)
        self.processes.clear()
