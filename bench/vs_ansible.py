"""Benchmark: ernie-deploy against ansible-playbook and pyinfra doing the same job on the same lab hosts.

    sudo .venv/bin/python bench/vs_ansible.py                          # 4 and 16 hosts, 5 runs each
    sudo .venv/bin/python bench/vs_ansible.py --hosts 4 --runs 3 --scenarios first,nochange

Boots its own lab (simulated A10 hosts from 127.0.0.101, real systemd and sshd) and tears it down; needs root.
Installs ansible-core and pyinfra from PyPI into the running environment when they are missing.

The job, for every tool: put the units and env files ernie-deploy renders on each host, restart only what
changed, make sure every unit runs and is enabled, wait until /health answers 200. The peers ship the files
`ernie-deploy render` wrote (bench/ansible/deploy.yml, bench/pyinfra/deploy.py), so a no-change run of each is
truly no change. ernie-deploy does more per run (facts, the lock, a release record, a stability window and a
verify after a restart); the figures are for the job as each tool does it.

Scenarios, runs alternating between the tools:
  first     every host clean (no unit), then deploy; includes one simulated model load
  nochange  deploy again onto hosts that run exactly these files
  rolling   restart every instance, one host at a time (ernie-deploy restart --serial 1; the peers with
            serial 1 / --serial); includes one simulated load per host
  slowversion  nochange while `vllm --version` takes 15 s on every host, as with real vLLM: ernie-deploy
            reads the version from the package metadata, so it must cost what nochange costs
ernie-deploy and Ansible work on min(hosts, 16) hosts at once (--forks / -f); pyinfra on every host at once.
Per tool: median and min-max wall seconds, ernie-deploy's ratio to it, control-machine CPU seconds per host
(user + system of the tool and its children), the lab hosts' CPU seconds per host (all of a container's
processes: sshd, shells, the simulators; from its cgroup), and SSH connections per host (sshd's journal on the
hosts).
The floor is a fresh Python that imports paramiko and makes one SSH connection plus one command per host, in
parallel.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ernie_deploy.lab import Lab, LabState
from ernie_deploy.lab.spec import parse_spec

BENCH = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
TOOLS = ("ernie-deploy", "ansible-playbook", "pyinfra")
SCENARIOS = ("first", "nochange", "rolling", "slowversion")
VERSION_SECONDS = 15.0  # real vLLM 0.33.0's `vllm --version` took 14-24 s on a 2-core machine (it imports torch)
LOAD_SECONDS = 2.0  # the simulated model load of every start, the same for all tools
CLEAN = ("for u in $(systemctl list-units --all --plain --no-legend 'ernie-vllm-*' | awk '{print $1}'); do "
         "systemctl disable --now -q $u; systemctl reset-failed $u; done 2>/dev/null; "
         "rm -rf /etc/systemd/system/ernie-vllm-* /etc/ernie-deploy /var/lib/ernie-deploy /var/log/ernie-deploy; "
         "systemctl daemon-reload")
RECAP = re.compile(r"^(\S+)\s+: ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.MULTILINE)


# Every tool runs as installed: with its bytecode cached (a shell that sets PYTHONDONTWRITEBYTECODE would
# make each run compile the sources again).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def compile_all() -> None:
    import ernie_deploy
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(ernie_deploy.__file__).parent)],
                   env=ENV, check=False, capture_output=True)


def install_peers() -> None:
    # By their programs: bench/ansible and bench/pyinfra (on sys.path as this script's folder) would pass for
    # the packages with importlib.
    missing = [pkg for pkg, program in (("ansible-core", "ansible-playbook"), ("pyinfra", "pyinfra"))
               if not (BIN / program).exists()]
    if missing:
        print(f"installing {', '.join(missing)} from PyPI", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing], check=True)


@dataclass
class Sample:
    wall: float
    cpu: float
    connections: float  # per host
    commands: str  # per host, as the tool reports it
    changed: str
    phases: dict[str, float] = field(default_factory=dict)  # ernie-deploy: median seconds per instance phase
    host_cpu: float = 0.0  # per host: CPU seconds the lab hosts spent (sshd, shells, the simulators...)


@dataclass
class Bench:
    lab: Lab
    state: LabState
    workdir: Path
    inventory: Path
    render_dir: Path
    key: str
    known_hosts: str
    results: dict[tuple[str, str], list[Sample]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.state.hosts)

    @property
    def forks(self) -> int:
        """Hosts worked on at once, the same for ernie-deploy and Ansible (pyinfra runs every host at once)."""
        return min(self.n, 16)

    def on_hosts(self, command: str) -> list[str]:
        with ThreadPoolExecutor(max_workers=16) as pool:
            return list(pool.map(lambda h: self.lab.ssh(h.name, command).stdout, self.state.hosts))

    def argv(self, tool: str, scenario: str) -> tuple[list[str], Path]:
        if tool == "ernie-deploy":
            forks = ["--forks", str(self.forks)]
            if scenario == "rolling":
                return [str(BIN / "ernie-deploy"), "restart", "-i", str(self.inventory), "--serial", "1",
                        *forks, "--json"], self.workdir
            return [str(BIN / "ernie-deploy"), "deploy", "-i", str(self.inventory), *forks, "--json"], self.workdir
        if tool == "ansible-playbook":
            book = "restart.yml" if scenario == "rolling" else "deploy.yml"
            return [str(BIN / "ansible-playbook"), "-i", str(self.workdir / "ansible-inventory.yml"),
                    "-f", str(self.forks), str(BENCH / "ansible" / book)], BENCH / "ansible"
        script = "restart.py" if scenario == "rolling" else "deploy.py"
        serial = ["--serial"] if scenario == "rolling" else []
        return [str(BIN / "pyinfra"), "-y", *serial, str(self.workdir / "pyinfra_inventory.py"),
                str(BENCH / "pyinfra" / script)], self.workdir

    def run(self, tool: str, scenario: str) -> Sample:
        argv, cwd = self.argv(tool, scenario)
        env = {**ENV, "RENDER_DIR": str(self.render_dir), "ANSIBLE_NOCOLOR": "1",
               "ANSIBLE_CONFIG": str(BENCH / "ansible" / "ansible.cfg"), "PATH": f"{BIN}:{os.environ['PATH']}"}
        cursors = self.on_hosts("journalctl -u ssh -n 0 --show-cursor --no-pager | sed -n 's/^-- cursor: //p'")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        host_before = self.host_cpu()
        t0 = time.perf_counter()
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800, check=False)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        host_cpu = (self.host_cpu() - host_before) / self.n
        if done.returncode != 0:
            raise SystemExit(f"{tool} {scenario} failed (rc {done.returncode}):\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-3000:]}")
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        # Connections accepted since the cursor, less the one that reads them.
        with ThreadPoolExecutor(max_workers=16) as pool:
            accepted = list(pool.map(lambda hc: self.lab.ssh(hc[0].name, (
                f"journalctl -u ssh --after-cursor '{hc[1].strip()}' -o cat --no-pager | grep -c '^Accepted' || true"
            )).stdout, zip(self.state.hosts, cursors, strict=True)))
        connections = sum(int(a.strip() or 0) - 1 for a in accepted) / self.n
        commands, changed, phases = "-", "-", {}
        if tool == "ernie-deploy":
            doc = json.loads(done.stdout)
            counts = [h.get("remote_commands", 0) for h in doc.get("hosts", [])]
            commands = f"{statistics.mean(counts):.1f}" if counts else "-"
            changed = str(sum(1 for h in doc.get("hosts", []) if h.get("status") == "changed"))
            phases = phases_of(doc.get("hosts", []), self.stable)
        elif tool == "ansible-playbook":
            stats = [(int(m[2]), int(m[3])) for m in RECAP.finditer(done.stdout)]
            commands = f"{statistics.mean(ok for ok, _ in stats):.1f} tasks" if stats else "-"
            changed = str(sum(c for _, c in stats))
        return Sample(wall, cpu / self.n, connections, commands, changed,
                      phases if tool == "ernie-deploy" else {}, host_cpu)

    def host_cpu(self) -> float:
        """CPU seconds the lab hosts have used so far, all processes of each container together (its cgroup2's
        cpu.stat); the idle simulated instances add about 2 ms a second per host."""
        total = 0
        for host in self.state.hosts:
            for cgroup in host.cgroups:
                stat = Path(cgroup) / "cpu.stat"
                if stat.is_file():
                    total += int(stat.read_text().split("usage_usec ", 1)[1].split()[0])
        return total / 1e6

    @property
    def stable(self) -> float:
        """The inventory's vllm_stable_seconds (the lab's), the window every start must stay healthy."""
        data = yaml.safe_load(self.inventory.read_text())
        return float(data["all"]["children"]["lab"]["vars"].get("vllm_stable_seconds", 3))

    def prepare(self, scenario: str) -> None:
        knobs = {"load_seconds": LOAD_SECONDS, **({"version_seconds": VERSION_SECONDS}
                                                  if scenario == "slowversion" else {})}
        self.on_hosts(f"mkdir -p /etc/ernie-lab && echo '{json.dumps(knobs)}' > /etc/ernie-lab/faults.json")
        if scenario == "first":
            self.on_hosts(CLEAN)
        else:
            self.ensure_deployed()

    def ensure_deployed(self) -> None:
        argv, cwd = self.argv("ernie-deploy", "nochange")
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=1800, env=ENV, check=False)
        if done.returncode != 0:
            raise SystemExit(f"ernie-deploy deploy (to prepare) failed (rc {done.returncode}):\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")

    def floor(self) -> float:
        """A fresh Python that imports paramiko, opens one SSH connection per host (strict host keys) and runs
        one command on each, all hosts in parallel: what any Python tool pays at least."""
        addresses = [h.address for h in self.state.hosts]
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", FLOOR, self.known_hosts, self.key, *addresses], check=True,
                       capture_output=True, timeout=120, env=ENV)
        return time.perf_counter() - t0


def step_kind(name: str) -> str:
    """A step's name without the units it names: `stop ernie-vllm-0.service` → `stop`."""
    return " ".join(w for w in name.split() if not w.startswith("ernie-vllm-")) or name


def phases_of(hosts: list[dict[str, object]], stable: float) -> dict[str, float]:
    """Median seconds per host of each kind of step (the readiness watch's `ready` split into `load`, until it
    first served, and `ready` after), and for a rolling restart the overhead per batch: the time between the ends
    of two consecutive hosts' work (one host a batch) beyond that host's stop, load and stability window."""
    per_host: list[dict[str, float]] = []
    for host in hosts:
        sums: dict[str, float] = {}
        for step in host.get("steps") or []:  # type: ignore[attr-defined]
            kind = step_kind(step["name"])
            sums[kind] = sums.get(kind, 0.0) + float(step["seconds"])
        timings = list((host.get("timings") or {}).values())  # type: ignore[attr-defined]
        load = sum(float(t.get("load", 0.0)) for t in timings)
        if "ready" in sums and load:
            sums["load"], sums["ready"] = load, sums["ready"] - load
        per_host.append(sums)
    kinds = {k for sums in per_host for k in sums}
    out = {k: statistics.median(s[k] for s in per_host if k in s) for k in kinds}
    ends = sorted((max(float(st["ended_at"]) for st in h.get("steps") or []), i)  # type: ignore[attr-defined]
                  for i, h in enumerate(hosts) if h.get("steps"))
    overheads = [ends[k][0] - ends[k - 1][0] - per_host[i].get("stop", 0.0) - per_host[i].get("load", 0.0) - stable
                 for k, (_, i) in enumerate(ends) if k and per_host[i].get("stop")]
    if overheads:
        out["overhead per batch"] = statistics.median(overheads)
    return out


FLOOR = """
import sys
from concurrent.futures import ThreadPoolExecutor
import paramiko
known, key, addresses = sys.argv[1], sys.argv[2], sys.argv[3:]
def one(address):
    client = paramiko.SSHClient()
    client.load_host_keys(known)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(address, username="root", key_filename=key, look_for_keys=False, allow_agent=False, timeout=10)
    try:
        _, out, _ = client.exec_command("true")
        out.channel.recv_exit_status()
    finally:
        client.close()
with ThreadPoolExecutor(max_workers=len(addresses)) as pool:
    list(pool.map(one, addresses))
"""


def boot(lab: Lab, n: int, workdir: Path) -> Bench:
    spec = parse_spec({"first_address": "127.0.0.101",
                       "hosts": [{"name": f"b{i + 1:02d}", "gpu_model": "NVIDIA A10", "gpu_count": 1}
                                 for i in range(n)]})
    state = lab.up(spec)
    data = yaml.safe_load(Path(state.inventory).read_text())
    group = data["all"]["children"]["lab"]
    key, known = str(group["vars"]["ansible_ssh_private_key_file"]), str(group["vars"]["ernie_known_hosts"])
    inventory = workdir / "inventory.yml"
    inventory.write_text(yaml.safe_dump(data))
    render_dir = workdir / "render"
    subprocess.run([str(BIN / "ernie-deploy"), "render", "-i", str(inventory), "-o", str(render_dir)],
                   check=True, capture_output=True)
    hosts = {h.name: {"ansible_host": h.address} for h in state.hosts}
    (workdir / "ansible-inventory.yml").write_text(yaml.safe_dump({"all": {"hosts": hosts, "vars": {
        "ansible_user": "root", "ansible_ssh_private_key_file": key,
        "ansible_ssh_common_args": f"-o UserKnownHostsFile={known}"}}}))
    (workdir / "pyinfra_inventory.py").write_text(
        "hosts = [\n" + "".join(
            f"    ({h.name!r}, {{'ssh_hostname': {h.address!r}, 'ssh_user': 'root', 'ssh_key': {key!r}, "
            f"'ssh_known_hosts_file': {known!r}, 'ssh_strict_host_key_checking': 'yes'}}),\n"
            for h in state.hosts) + "]\n")
    bench = Bench(lab, state, workdir, inventory, render_dir, key, known)
    return bench


def stats(samples: Sequence[Sample]) -> tuple[float, float, float]:
    walls = [s.wall for s in samples]
    return statistics.median(walls), min(walls), max(walls)


def report(bench: Bench, scenarios: Sequence[str], floor: list[float]) -> None:
    n = bench.n
    print(f"\n## {n} hosts (median of {len(next(iter(bench.results.values())))} runs, seconds)\n")
    print("| scenario | tool | median | min-max | ernie-deploy ÷ tool | without load | CPU s/host | host CPU s/host | "
          "SSH conn./host | commands/host | changed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for scenario in scenarios:
        ours = stats(bench.results[(scenario, "ernie-deploy")])[0]
        loads = {"first": LOAD_SECONDS, "rolling": LOAD_SECONDS * n}.get(scenario, 0.0)
        for tool in TOOLS:
            samples = bench.results[(scenario, tool)]
            med, lo, hi = stats(samples)
            ratio = f"{ours / med:.2f}"
            bare = f"{(ours - loads) / (med - loads):.2f}" if loads and med > loads and ours > loads else "-"
            print(f"| {scenario} | {tool} | {med:.2f} | {lo:.2f}-{hi:.2f} | {ratio} | {bare} | "
                  f"{statistics.median(s.cpu for s in samples):.3f} | "
                  f"{statistics.median(s.host_cpu for s in samples):.3f} | "
                  f"{statistics.median(s.connections for s in samples):.1f} | {samples[-1].commands} | "
                  f"{samples[-1].changed} |")
    phased = [s for s in scenarios if any(x.phases for x in bench.results[(s, "ernie-deploy")])]
    if phased:
        print("\nernie-deploy, seconds per host by step (median over hosts, then runs); `load` until the instance "
              "first served, `ready` the rest of the watch (stability window and checks)\n")
        print("| step | " + " | ".join(phased) + " |")
        print("|---|" + "---|" * len(phased))
        runs = {s: [x.phases for x in bench.results[(s, "ernie-deploy")] if x.phases] for s in phased}
        order = ["facts", "lock", "balancer", "drain", "stop", "gpu release", "stage", "start", "load", "ready",
                 "checks", "overhead per batch"]
        kinds = sorted({k for r in runs.values() for p in r for k in p},
                       key=lambda k: (order.index(k) if k in order else len(order), k))
        for kind in kinds:
            cells = [statistics.median(p[kind] for p in runs[s] if kind in p)
                     if any(kind in p for p in runs[s]) else None for s in phased]
            print(f"| {kind} | " + " | ".join("" if c is None else f"{c:.2f}" for c in cells) + " |")
    fmed = statistics.median(floor)
    nochange = bench.results.get(("nochange", "ernie-deploy"))
    ratio = f"; no-change ernie-deploy ÷ floor: {stats(nochange)[0] / fmed:.2f}" if nochange else ""
    print(f"\nfloor (1 connection + 1 command per host, parallel): median {fmed:.2f} s{ratio}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="4,16", help="lab sizes, comma-separated (default 4,16)")
    parser.add_argument("--runs", type=int, default=5, help="runs per tool and scenario (default 5)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="first,nochange,rolling")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("the lab needs root: sudo .venv/bin/python bench/vs_ansible.py", file=sys.stderr)
        return 2
    scenarios = [s for s in args.scenarios.split(",") if s]
    if unknown := set(scenarios) - set(SCENARIOS):
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    install_peers()
    compile_all()
    versions = {tool: subprocess.run([str(BIN / tool), "--version"], capture_output=True, text=True
                                     ).stdout.splitlines()[0].strip() for tool in TOOLS}
    print(f"machine: {os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f}"
          f" GiB, {platform.platform()}, Python {platform.python_version()}; {'; '.join(versions.values())}")
    for n in (int(x) for x in args.hosts.split(",")):
        workdir = Path(tempfile.mkdtemp(prefix=f"bench-{n}-"))
        lab = Lab(workdir / "lab", progress=lambda m: print(f"[lab] {m}", flush=True))
        try:
            bench = boot(lab, n, workdir)
            floor = [bench.floor() for _ in range(args.runs)]
            for scenario in scenarios:
                for run in range(args.runs):
                    order = TOOLS[run % 3:] + TOOLS[:run % 3]  # alternate who goes first
                    for tool in order:
                        bench.prepare(scenario)
                        sample = bench.run(tool, scenario)
                        bench.results.setdefault((scenario, tool), []).append(sample)
                        print(f"  {n} hosts {scenario:<8} {tool:<16} {sample.wall:6.2f} s  changed={sample.changed}",
                              flush=True)
            report(bench, scenarios, floor)
        finally:
            lab.down()
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
