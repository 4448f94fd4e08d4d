"""A real Slurm cluster on one machine: one network namespace (own address, own hostname) per node.

    with SlurmCluster.start(Path(tmp), nodes=4) as c:
        job = c.sbatch(["slurm/train.sh", "+exp=smoke"], cwd=repo)
        c.wait_state(job, {"COMPLETED"})

Topology: a private "switch" namespace holds a bridge; each node namespace ``<tag>-nI`` has a veth ``eth0``
on it with address 127.100.<x>.I/24 (traffic here may only go to loopback addresses: each namespace sets
``route_localnet=1`` and shrinks lo to 127.0.0.1/32, so 127.100.<x>.0/24 is routed over eth0 to the other
namespaces, never to the host or beyond), and every daemon of node I runs in that network namespace plus its own
UTS (hostname ``nodeI``) and mount namespace (an /etc/hosts naming all nodes bind-mounted over the real one).
slurmctld runs on node1, like a head node. munged runs in the host namespace (a filesystem socket reaches
every node). Clients (sbatch, squeue, scontrol) run inside node1's namespaces via ``nsenter``.

Daemons are started with ``nsenter --net=...`` (not ``ip netns exec``, which remounts /sys and breaks slurmd),
and everything is stopped by PID: the daemons' pid files, then every process left in a node's network
namespace.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

SLURM_BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "squeue")


def unavailable_reason() -> Optional[str]:
    """Why a cluster cannot be started here (None: it can)."""
    if os.geteuid() != 0:
        return "the Slurm tests need root (network namespaces, slurmd); run as root or in CI"
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        return f"slurm-wlm is not installed (missing {', '.join(missing)}); apt-get install -y slurm-wlm"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"'{tool}' is missing (iproute2 / util-linux)"
    return None


def _sh(cmd: Sequence[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stdout}\n{proc.stderr}")
    return proc


class SlurmCluster:
    def __init__(self, root: Path, nodes: int):
        self.root = root
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)]
        self.tag = "lmf" + secrets.token_hex(2)
        self.subnet = f"127.100.{secrets.randbelow(200) + 20}"
        self.addr = {n: f"{self.subnet}.{i}" for i, n in enumerate(self.nodes, start=1)}
        self.ns = {n: f"{self.tag}-n{i}" for i, n in enumerate(self.nodes, start=1)}
        self.switch = f"{self.tag}-sw"
        self.conf = root / "slurm.conf"
        self.hosts = root / "hosts"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.netns_made: List[str] = []
        self.daemon_pids: Dict[str, int] = {}

    # ---- lifecycle ------------------------------------------------------------------------------------
    @classmethod
    def start(cls, root: Path, nodes: int = 4) -> "SlurmCluster":
        c = cls(root, nodes)
        try:
            c._network()
            c._config()
            c._munge()
            c._daemons()
            c.wait_idle(len(c.nodes), timeout=60)
        except BaseException:
            c.stop()
            raise
        return c

    def __enter__(self) -> "SlurmCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _network(self) -> None:
        _sh(["ip", "netns", "add", self.switch])
        self.netns_made.append(self.switch)
        _sh(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _sh(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for i, node in enumerate(self.nodes, start=1):
            ns = self.ns[node]
            _sh(["ip", "netns", "add", ns])
            self.netns_made.append(ns)
            a, b = f"{self.tag}a{i}", f"{self.tag}b{i}"
            _sh(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
            _sh(["ip", "link", "set", a, "netns", ns])
            _sh(["ip", "link", "set", b, "netns", self.switch])
            _sh(["ip", "-n", self.switch, "link", "set", b, "master", "br0", "up"])
            _sh(["ip", "-n", ns, "link", "set", a, "name", "eth0"])
            # 127.* off lo may be routed (sysctl of the namespace nsenter puts it in: /proc/sys/net is per-netns);
            # lo keeps only 127.0.0.1, so the rest of 127/8 is no longer "this host".
            _sh(["nsenter", f"--net=/run/netns/{ns}", "sysctl", "-q", "-w", "net.ipv4.conf.all.route_localnet=1"])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            _sh(["ip", "-n", ns, "addr", "del", "127.0.0.1/8", "dev", "lo"])
            _sh(["ip", "-n", ns, "addr", "add", "127.0.0.1/32", "dev", "lo"])
            _sh(["ip", "-n", ns, "addr", "add", f"{self.addr[node]}/24", "dev", "eth0"])
            _sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
        lines = ["127.0.0.1 localhost"] + [f"{self.addr[n]} {n}" for n in self.nodes]
        self.hosts.write_text("\n".join(lines) + "\n")

    def _config(self) -> None:
        d = self.root
        for sub in ("state", "log", "run", "munge", "msock", *[f"spool/{n}" for n in self.nodes]):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)
        os.chmod(d / "msock", 0o755)
        os.chmod(d / "munge", 0o700)
        head = self.nodes[0]
        node_lines = "\n".join(
            f"NodeName={n} NodeHostname={n} NodeAddr={self.addr[n]} CPUs=4 RealMemory=4000" for n in self.nodes
        )
        self.conf.write_text(f"""\
ClusterName=lmforge-test
SlurmctldHost={head}({self.addr[head]})
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/msock/sock,cred_expire=10
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=sched_interval=2,bf_interval=1
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={d}/log/jobcomp.txt
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
# Each node offers 4 CPUs whatever the host has: 1-CPU tasks of four jobs share a node.
SlurmdParameters=config_overrides
SlurmdTimeout=6
KillWait=5
MinJobAge=600
{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _munge(self) -> None:
        d = self.root
        key = d / "munge" / "key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        _sh(
            [
                "munged",
                f"--socket={d}/msock/sock",
                f"--key-file={key}",
                f"--pid-file={d}/run/munged.pid",
                f"--log-file={d}/log/munged.log",
                f"--seed-file={d}/munge/seed",
                "--force",
            ]
        )
        self.daemon_pids["munged"] = self._read_pid(d / "run" / "munged.pid")

    def in_node(self, node: str, cmd: Sequence[str]) -> List[str]:
        """A command line that runs ``cmd`` in ``node``'s network, UTS and mount namespaces."""
        script = 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"'
        return [
            "nsenter",
            f"--net=/run/netns/{self.ns[node]}",
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            str(self.hosts),
            node,
            *cmd,
        ]

    def _daemons(self) -> None:
        head = self.nodes[0]
        _sh(self.in_node(head, ["slurmctld"]), env=self.env, timeout=30)
        self.daemon_pids["slurmctld"] = self._read_pid(self.root / "run" / "slurmctld.pid")
        for node in self.nodes:
            self.start_slurmd(node)

    def start_slurmd(self, node: str) -> None:
        pidfile = self.root / "run" / f"slurmd-{node}.pid"
        if pidfile.exists():
            pidfile.unlink()
        _sh(self.in_node(node, ["slurmd", "-N", node]), env=self.env, timeout=30)
        self.daemon_pids[f"slurmd-{node}"] = self._read_pid(pidfile)

    @staticmethod
    def _read_pid(path: Path, timeout: float = 10) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                text = path.read_text().strip()
                if text:
                    return int(text)
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"daemon did not write {path}")

    def pids_in_node(self, node: str) -> List[int]:
        """Every process whose network namespace is ``node``'s (its daemons and job processes)."""
        try:
            target_ino = os.stat(f"/run/netns/{self.ns[node]}").st_ino
        except OSError:
            return []
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == target_ino:
                    found.append(int(entry))
            except OSError:
                continue
        return found

    def kill_node(self, node: str) -> List[int]:
        """A node failure: SIGKILL its slurmd, slurmstepds and job processes (by PID). Returns the PIDs."""
        pids = self.pids_in_node(node)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def stop(self) -> None:
        for name, pid in list(self.daemon_pids.items()):
            if name == "munged":
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p) for n, p in self.daemon_pids.items() if n != "munged"):
            time.sleep(0.1)
        for node in self.nodes:
            self.kill_node(node)
        for pid in self.daemon_pids.values():
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.daemon_pids.clear()
        time.sleep(0.2)
        for ns in reversed(self.netns_made):
            _sh(["ip", "netns", "del", ns], check=False)
        self.netns_made.clear()

    # ---- clients --------------------------------------------------------------------------------------
    def client(
        self,
        cmd: Sequence[str],
        check: bool = True,
        cwd: Optional[Path] = None,
        env: Optional[Dict[str, str]] = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess:
        full = ["nsenter", f"--net=/run/netns/{self.ns[self.nodes[0]]}", *cmd]
        return _sh(full, check=check, cwd=cwd, env={**self.env, **(env or {})}, timeout=timeout)

    def sbatch(self, args: Sequence[str], cwd: Path, env: Optional[Dict[str, str]] = None) -> str:
        out = self.client(["sbatch", "--parsable", *args], cwd=cwd, env=env).stdout.strip()
        return out.split(";")[0]

    def job_info(self, job: str) -> Dict[str, str]:
        proc = self.client(["scontrol", "-o", "show", "job", job], check=False)
        info: Dict[str, str] = {}
        for m in re.finditer(r"(\w+)=(\S*)", proc.stdout):
            info.setdefault(m.group(1), m.group(2))
        return info

    def wait_state(
        self,
        job: str,
        states: Iterable[str],
        timeout: float = 180,
        fail_states: Iterable[str] = ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"),
    ) -> Dict[str, str]:
        states, fails = set(states), set(fail_states)
        deadline = time.monotonic() + timeout
        info: Dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_info(job)
            state = info.get("JobState", "")
            if state in states:
                return info
            if state in fails:
                raise AssertionError(f"job {job} ended {state}: {info}\n{self.logs_tail()}")
            time.sleep(0.5)
        raise AssertionError(f"job {job} not in {states} after {timeout}s: {info}\n{self.logs_tail()}")

    def node_states(self) -> Dict[str, str]:
        out = self.client(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def wait_idle(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(1 for s in self.node_states().values() if s == "idle") >= count:
                return
            time.sleep(0.2)
        raise RuntimeError(f"only {self.node_states()} after {timeout}s\n{self.logs_tail()}")

    def logs_tail(self, n: int = 30) -> str:
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-n:]
            parts.append(f"--- {log.name} ---\n" + "\n".join(lines))
        return "\n".join(parts)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return False
