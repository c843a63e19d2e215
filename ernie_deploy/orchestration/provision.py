"""`provision`: make a bare GPU box ready for `deploy`, per host, in order: the driver check, the service user,
OS prerequisites, vLLM at the pinned version in its own venv, old venvs removed, the model files.

Every decision comes from one probe (taken with the deploy lock). Nothing is installed on a host whose
driver is too old; each change is audited on the host; an interrupted copy resumes on the next run.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ernie_deploy.errors import DeployError
from ernie_deploy.orchestration import audit, localfiles
from ernie_deploy.orchestration.details import ProvisionReport
from ernie_deploy.orchestration.fleet import Fleet, HostRun
from ernie_deploy.orchestration.results import Status
from ernie_deploy.orchestration.snapshot import SnapshotOptions, lock_and_gather, release_lock
from ernie_deploy.orchestration.steps import StepStatus
from ernie_deploy.orchestration.transport import RemoteHost
from ernie_deploy.planning.drivers import judge, need
from ernie_deploy.planning.hostpaths import WHEELHOUSE
from ernie_deploy.planning.plan import PlanContext, plan_host
from ernie_deploy.planning.provisioning import (
    Entry,
    HubSource,
    Manifest,
    ProvisionSpec,
    extra_on_host,
    os_packages,
    removable_venvs,
    spec_for,
    to_send,
    trusted,
    unknown_on_host,
)
from ernie_deploy.planning.settings import host_secrets
from ernie_deploy.remote import filesync, hub, lock
from ernie_deploy.remote import provision as remote
from ernie_deploy.remote.command import Command
from ernie_deploy.remote.protocol import sha256sums

MIB = 1024 * 1024
# Room left on the model's file system after a copy: a disk filled to the last byte breaks journald and
# the instances' own logs.
DISK_MARGIN = 256 * MIB
GIB = 1024 * MIB
# An installed venv takes this many times its wheels' size: wheels are zip archives; the lab's vLLM 0.32.0 CPU
# wheelhouse (859 MiB of wheels) unpacks to 3003 MiB, 3.5 times (docs/provisioning.md, "Disk space").
UNPACK_FACTOR = 4
# Without a wheelhouse to measure, what an install from an index needs (docs/provisioning.md, "Disk space"):
# a CUDA build, and vLLM's CPU build (a `+cpu` version: ~900 MB of wheels, docs/lab.md).
INDEX_INSTALL_BYTES = 10 * GIB
CPU_INDEX_INSTALL_BYTES = 4 * GIB
NO_SPACE = ("No space left on device", "[Errno 28]")


@dataclass(frozen=True)
class ProvisionOptions:
    base_dir: Path  # the inventory's directory: relative vllm_model_source / vllm_pip_find_links start there
    check: bool = False
    verify_files: bool = False
    rate: float | None = None  # bytes per second per copy stream (--bwlimit)
    lock_wait: float = 0.0
    command: str = "ernie-deploy provision"


class Provisioner:
    def __init__(self, ctx: PlanContext, options: ProvisionOptions, fleet: Fleet) -> None:
        self.ctx = ctx
        self.options = options
        self.fleet = fleet
        self.lock = lock.LockInfo.mine(options.command)
        self.hashes = localfiles.HashCache()
        self._manifests: dict[Path, Manifest] = {}
        self._manifest_lock = threading.Lock()

    def run(self, hosts: Sequence[RemoteHost]) -> list[HostRun[None]]:
        """Each host's run; its result's detail is the ProvisionReport."""
        try:
            return self.fleet.run(hosts, [self._host], release=release_lock)
        finally:
            self.hashes.save()

    # -- one host ------------------------------------------------------------------------------------

    def _host(self, run: HostRun[None]) -> None:
        report = ProvisionReport()
        run.result.detail = report
        plan = plan_host(run.host, self.ctx)
        inputs = [f for f in plan.errors if f.code == "input"]
        if inputs:
            raise DeployError(inputs[0].message, where=run.host.name, hint=inputs[0].fix)
        spec = spec_for(plan, run.host.vars, self.options.base_dir)
        session = self.fleet.connect(run)
        self.fleet.progress(run.host.name, "probing")
        with self.fleet.step(run, "probe"):
            probe = remote.probe_command(spec)
            if self.options.check:
                text = session.run(probe).text
            else:
                text = lock_and_gather(self.fleet, run, SnapshotOptions(lock=self.lock,
                                                                        lock_wait=self.options.lock_wait),
                                       probe.intent)
        facts = remote.parse_probe(text)
        self._driver(spec, facts, report)
        for step in (self._user, self._prerequisites, self._vllm, self._prune, self._model):
            if self.fleet.abort.is_set():  # Ctrl-C / SIGTERM: finish the step that runs, start no other
                why = "interrupted" if self.fleet.interrupted else "another host failed (--any-errors-fatal)"
                raise DeployError(f"{why}: stopped between steps; what is done stays done", where=spec.host,
                                  hint="run provision again to finish")
            step(run, spec, facts, report)
        if any(a["status"] == StepStatus.CHANGED for a in report.actions) and run.result.status is Status.OK:
            run.result.status = Status.CHANGED

    def _audit(self, run: HostRun[None], step: str, **detail: object) -> dict[str, object]:
        return audit.record(self.lock, run.host.name, "provision", step=step, **detail)

    def _change(self, run: HostRun[None], report: ProvisionReport, step: str, detail: str, cmd: Command | None) -> bool:
        """Record a change; run it unless in check mode. True when it ran."""
        if self.options.check:
            report.add(step, StepStatus.WOULD_CHANGE, detail)
            return False
        assert cmd is not None and run.session is not None
        self.fleet.progress(run.host.name, detail)
        with self.fleet.step(run, step) as st:
            run.session.run(cmd)
            st.changed = True
        report.add(step, StepStatus.CHANGED, detail)
        return True

    def _driver(self, spec: ProvisionSpec, facts: remote.ProvisionFacts, report: ProvisionReport) -> None:
        wanted = need(spec.version)
        if facts.driver is None:
            minimum = f" (vLLM {spec.version} needs {wanted.minimum} or newer)" if wanted else ""
            raise DeployError(f"no NVIDIA driver answers: {facts.driver_error}{minimum}; nothing was installed",
                              where=spec.host, hint="install the NVIDIA driver first: provisioning checks it, it "
                                                    "never installs drivers or CUDA (docs/provisioning.md)")
        report.driver = facts.driver
        if wanted is None:
            report.add("driver", StepStatus.OK, f"driver {facts.driver}; no driver data for vLLM {spec.version} "
                                       "(older than docs/drivers.md covers)")
            return
        verdict = judge(facts.driver, wanted)
        if verdict.ok is False:
            raise DeployError(f"{verdict.summary}; nothing was installed", where=spec.host,
                              hint=f"upgrade the NVIDIA driver to {wanted.minimum} or newer, or pin an older "
                                   "vllm_version (docs/drivers.md)")
        report.add("driver", StepStatus.OK, verdict.summary)

    def _user(self, run: HostRun[None], spec: ProvisionSpec, facts: remote.ProvisionFacts,
              report: ProvisionReport) -> None:
        if facts.user is not None:
            report.add("service user", StepStatus.OK,
                       f"{spec.user} exists (home {facts.user[1]}, shell {facts.user[2]})")
            return
        self._change(run, report, "service user", f"create system user {spec.user} (no login shell)",
                     remote.create_user_command(spec.user, self._audit(run, "create user", name=spec.user)))

    def _prerequisites(self, run: HostRun[None], spec: ProvisionSpec, facts: remote.ProvisionFacts,
                       report: ProvisionReport) -> None:
        if facts.python == "ok":
            report.add("prerequisites", StepStatus.OK, "python3 with venv and ensurepip")
            return
        family = os_packages(facts.os_ids)
        what = "python3" if facts.python == "no-python3" else "python3's venv/ensurepip modules"
        if family is None:
            raise DeployError(f"{what} missing, and the OS ({' '.join(facts.os_ids) or 'unknown'}) is not one "
                              "provisioning knows packages for", where=spec.host,
                              hint="install python3 with its venv module by hand, then run provision again")
        manager, packages = family
        if not spec.install_os_packages:
            raise DeployError(f"{what} missing: install {' '.join(packages)}", where=spec.host,
                              hint=f"{manager} install {' '.join(packages)} on the host, or set "
                                   "vllm_install_os_packages: true to let provision do it")
        self._change(run, report, "prerequisites", f"{manager} install {' '.join(packages)}",
                     remote.os_packages_command(manager, packages,
                                                self._audit(run, "os packages", packages=list(packages))))

    def _vllm(self, run: HostRun[None], spec: ProvisionSpec, facts: remote.ProvisionFacts,
              report: ProvisionReport) -> None:
        report.vllm = {"version": spec.version, "venv": spec.venv, "bin": spec.bin}
        if facts.version == spec.version and facts.venv in ("ours", "foreign"):
            how = "installed by provision" if facts.venv == "ours" else "adopted: installed before, metadata matches"
            report.vllm["state"] = "present" if facts.venv == "ours" else "adopted"
            report.add("vllm", StepStatus.OK, f"vLLM {spec.version} at {spec.venv} ({how})")
            return
        if facts.venv == "foreign":
            found = f"vLLM {facts.version}" if facts.version else "no readable vLLM"
            raise DeployError(f"{spec.venv} holds {found}, not {spec.version}, and provisioning did not make it, "
                              "so it is left alone", where=spec.host,
                              hint="point vllm_bin at a new VENV/bin/vllm, or leave vllm_bin unset to get "
                                   f"/opt/vllm/{spec.version}")
        if facts.venv == "ours" and facts.version not in (None, spec.version) and spec.venv in facts.used:
            raise DeployError(f"{spec.venv} holds vLLM {facts.version}, which installed units or kept releases run; "
                              f"replacing it with {spec.version} would switch them silently", where=spec.host,
                              hint="give the new version its own venv: leave vllm_bin unset (/opt/vllm/VERSION) "
                                   "or point it at a new path")
        source = (f"wheelhouse {spec.find_links}" if spec.find_links else "the host's package index") + \
            (" and vllm_pip_index_url" if spec.index_url else "")
        detail = f"install vLLM {spec.version} into {spec.venv} from {source}"
        report.vllm["state"] = "installed"
        need = self._room_for_vllm(spec, facts)
        if self.options.check:
            report.add("vllm", StepStatus.WOULD_CHANGE, detail)
            return
        links = None
        if spec.find_links is not None:
            self._sync(run, spec, "wheelhouse", spec.find_links, WHEELHOUSE, facts.wheels, "root")
            links = WHEELHOUSE

        audit = self._audit(run, "install vllm", version=spec.version, venv=spec.venv)
        assert run.session is not None
        self.fleet.progress(run.host.name, f"installing vLLM {spec.version} (pip)")
        with self.fleet.step(run, "install vllm") as st:
            r = run.session.run(remote.install_command(spec, links, audit))
            st.changed = True
        if r.code != 0:
            out = (r.text + "\n" + r.stderr.decode(errors="replace")).strip()
            if spec.index_url is not None:
                out = out.replace(spec.index_url.reveal(), "[REDACTED]")
            tail = "\n".join(out.splitlines()[-8:])
            if any(mark in out for mark in NO_SPACE):
                # A full disk shows up as whatever step ran out first (ensurepip, a wheel): name the disk.
                raise DeployError(f"installing vLLM {spec.version} into {spec.venv} ran out of disk space (exit "
                                  f"{r.code}); {facts.venv_disk.mount} held {_size(facts.venv_disk.free_bytes)} "
                                  f"free before, about {_size(need)} is needed:\n{tail}", where=spec.host,
                                  hint=f"free space on {facts.venv_disk.mount} (and pip's temporary directory, "
                                       "TMPDIR or /tmp), or point vllm_bin at a venv on a larger disk; then run "
                                       "provision again")
            raise DeployError(f"installing vLLM {spec.version} into {spec.venv} failed (exit {r.code}):\n{tail}",
                              where=spec.host, hint="check that the index or wheelhouse has vllm=="
                                                    f"{spec.version} for this Python, then run provision again")
        report.add("vllm", StepStatus.CHANGED, detail)

    def _room_for_vllm(self, spec: ProvisionSpec, facts: remote.ProvisionFacts) -> int:
        """The bytes the install needs on the venv's disk; fails, before anything is copied or installed, when
        that disk has less free (like the model copy). Unknown free space (df said nothing) is not a refusal."""
        if spec.find_links is not None:
            wheels = self._manifest(spec.find_links)
            need = UNPACK_FACTOR * sum(e.size for e in wheels.values())
            if facts.wheels_mount == facts.venv_disk.mount:  # the wheelhouse copy comes out of the same room
                need += sum(e.size for rel, e in wheels.items() if rel not in facts.wheels.present)
            how = f"{UNPACK_FACTOR} times the wheelhouse's {_size(need // UNPACK_FACTOR)}"
        else:
            cpu = spec.version.endswith("+cpu")
            need = CPU_INDEX_INSTALL_BYTES if cpu else INDEX_INSTALL_BYTES
            how = f"the estimate for {'a CPU' if cpu else 'a CUDA'} build from an index"
        free = facts.venv_disk.free_bytes
        if free is not None and need + DISK_MARGIN > free:
            raise DeployError(f"installing vLLM {spec.version} into {spec.venv} needs about {_size(need)} ({how}) "
                              f"on {facts.venv_disk.mount}, which has {_size(free)} free (keeping "
                              f"{_size(DISK_MARGIN)} spare); nothing was installed", where=spec.host,
                              hint=f"free space on {facts.venv_disk.mount}, or point vllm_bin at a venv on a "
                                   "larger disk (docs/provisioning.md, \"Disk space\")")
        return need

    def _prune(self, run: HostRun[None], spec: ProvisionSpec, facts: remote.ProvisionFacts,
               report: ProvisionReport) -> None:
        old = removable_venvs(list(facts.venvs), set(facts.used), spec.venv)
        if old:
            self._change(run, report, "old venvs", f"remove {', '.join(old)} (no unit or kept release runs them)",
                         remote.prune_command(old, self._audit(run, "remove venvs", venvs=old)))

    # -- files -----------------------------------------------------------------------------------------

    def _manifest(self, root: Path) -> Manifest:
        with self._manifest_lock:  # hosts sharing a source hash it once
            if root not in self._manifests:
                self._manifests[root] = localfiles.scan(root, self.hashes)
            return self._manifests[root]

    def _model(self, run: HostRun[None], spec: ProvisionSpec, facts: remote.ProvisionFacts,
               report: ProvisionReport) -> None:
        if spec.source is None:
            report.add("model", StepStatus.OK, f"{spec.model_path}: no vllm_model_source, left as it is")
            return
        if isinstance(spec.source, HubSource):
            self._hub(run, spec, spec.source, facts, report)
            return
        self._sync(run, spec, "model", spec.source.path, spec.model_path, facts.model, spec.user, report)

    def _sync(self, run: HostRun[None], spec: ProvisionSpec, step: str, local: Path, target: str,
              state: filesync.DirState, owner: str, report: ProvisionReport | None = None) -> None:
        """Make `target` on the host hold exactly the files of `local`, sending only what differs."""
        assert run.session is not None
        wanted = self._manifest(local)
        verify = self.options.verify_files and step == "model"
        held = {} if verify else trusted(state.recorded, state.present)
        unknown = sorted(r for r in wanted if r in state.present) if verify else \
            unknown_on_host(wanted, held, state.present)
        if unknown:
            self.fleet.progress(run.host.name, f"hashing {len(unknown)} files on the host")
            with self.fleet.step(run, f"{step}: hash host files"):
                found = sha256sums(run.session.run(filesync.hash_command(target, unknown)).text)
            held.update({rel: wanted[rel] for rel, digest in found.items()
                         if rel in wanted and digest == wanted[rel].sha256})
        send = to_send(wanted, held)
        extra = extra_on_host(wanted, state.present)
        total = sum(e.size for e in wanted.values())
        up_to_date = not send and not extra and state.kind == "dir" and set(state.recorded) == set(wanted) \
            and not unknown and state.source == str(local)
        if report is not None:
            report.model = {"path": target, "source": str(local), "files": len(wanted), "bytes": total,
                            "send_files": len(send), "send_bytes": sum(wanted[r].size for r in send),
                            "extra_files": extra, "sent_bytes": 0, "resumed_bytes": 0}
        if up_to_date:
            if report is not None:
                report.add(step, StepStatus.OK, f"{target}: {len(wanted)} files, {_mib(total)}, as in {local}")
            return
        detail = f"{target}: send {len(send)} of {len(wanted)} files ({_mib(sum(wanted[r].size for r in send))})" + \
            (f", drop {len(extra)} not in the source" if extra else "") + ", then switch in"
        if self.options.check:
            if report is not None:
                report.add(step, StepStatus.WOULD_CHANGE, detail)
            return
        unique = {wanted[r].sha256: (r, wanted[r]) for r in send}
        staged = {sha: n for sha, n in state.staged.items()}
        need_bytes = sum(e.size - (staged.get(sha + ".part", 0) if staged.get(sha + ".part", 0) <= e.size else 0)
                         for sha, (_, e) in unique.items() if staged.get(sha) != e.size)
        if state.free_bytes is not None and need_bytes + DISK_MARGIN > state.free_bytes:
            raise DeployError(f"{_mib(need_bytes)} to copy next to {target}, but only {_mib(state.free_bytes)} "
                              f"free there (keeping {_mib(DISK_MARGIN)} spare); nothing was copied",
                              where=spec.host, hint="free space on that file system, or move vllm_model")
        sent = resumed = 0
        for sha, (rel, entry) in sorted(unique.items(), key=lambda kv: kv[1][0]):
            if staged.get(sha) == entry.size:
                continue  # complete from an earlier, interrupted run
            offset = staged.get(sha + ".part", 0)
            offset = offset if offset <= entry.size else 0
            resumed += offset
            sent += self._send(run, spec, step, local / rel, rel, target, entry, offset)
        if report is not None:
            report.model.update(sent_bytes=sent, resumed_bytes=resumed)
        audit = self._audit(run, f"switch {step}", target=target, source=str(local), sent=sorted(send),
                            dropped=extra)
        with self.fleet.step(run, f"{step}: switch in") as st:
            run.session.run(filesync.switch_command(target, wanted, [r for r in wanted if r not in send], owner,
                                                    str(local), audit))
            st.changed = True
        if report is not None:
            report.add(step, StepStatus.CHANGED, detail + (f" ({_mib(resumed)} resumed)" if resumed else ""))

    def _send(self, run: HostRun[None], spec: ProvisionSpec, step: str, path: Path, rel: str, target: str,
              entry: Entry, offset: int) -> int:
        assert run.session is not None
        host = run.host.name

        def sent(n: int) -> None:
            self.fleet.progress(host, f"copying {rel}: {_mib(offset + n)} of {_mib(entry.size)}")

        stream = localfiles.chunks(path, offset, rate=self.options.rate, sent=sent, stop=self.fleet.abort.is_set)
        with self.fleet.step(run, f"{step}: copy {rel}") as st:
            r = run.session.run(filesync.receive_command(target, entry, offset, stream))
            st.changed = True
        if r.code == 0:
            return entry.size - offset
        arrived = r.text.split()[1] if r.text.startswith("incomplete ") and len(r.text.split()) > 1 else "?"
        if r.code == filesync.INCOMPLETE_EXIT:
            why = "interrupted" if self.fleet.abort.is_set() else "the stream ended early"
            raise DeployError(f"copy of {rel} {why}: {arrived} of {entry.size} bytes are on the host; nothing was "
                              "switched in", where=spec.host, hint="run provision again: it resumes the copy")
        if r.code == filesync.MISMATCH_EXIT:
            raise DeployError(f"{rel} arrived with a different sha256 than sent (changed while copying?); the "
                              "partial copy was removed", where=spec.host, hint="run provision again")
        raise DeployError(f"receiving {rel} failed (exit {r.code}): {r.stderr.decode(errors='replace').strip()}",
                          where=spec.host)

    def _hub(self, run: HostRun[None], spec: ProvisionSpec, source: HubSource, facts: remote.ProvisionFacts,
             report: ProvisionReport) -> None:
        state = facts.model
        report.model = {"path": spec.model_path, "source": source.describe()}
        detail = f"{spec.model_path}: download {source.describe()} on the host, then switch in"
        if self.options.check:
            # Whether the revision moved is only known on the host (it asks the Hub): say what would be asked.
            report.add("model", StepStatus.WOULD_CHECK, detail + " if the revision's commit differs from "
                                               f"{state.source or 'nothing recorded'}")
            return
        assert run.session is not None
        self.fleet.progress(run.host.name, f"downloading {source.describe()} on the host")
        token = host_secrets(run.host.vars, spec.host).get("HF_TOKEN")
        with self.fleet.step(run, "model: hub download"):
            r = run.session.run(hub.download_command(spec, source, state, self.options.verify_files,
                                                     token.reveal() if token else ""))
        result = hub.parse_result(r.text)
        if r.code != 0 or result.error:
            why = result.error or f"exit {r.code}: {r.stderr.decode(errors='replace').strip()}"
            if token:
                why = why.replace(token.reveal(), "[REDACTED]")
            raise DeployError(f"downloading {source.describe()} failed: {why}", where=spec.host,
                              hint="check the repository, the revision, hf_token and HF_ENDPOINT in vllm_env")
        report.model.update(commit=result.source, files=len(result.files), bytes=result.bytes)
        if not result.changed:
            report.add("model", StepStatus.OK, f"{spec.model_path}: {result.source} already there")
            return
        audit = self._audit(run, "switch model", target=spec.model_path, source=result.source,
                            files=len(result.files))
        with self.fleet.step(run, "model: switch in") as st:
            run.session.run(filesync.switch_command(spec.model_path, result.files, [], spec.user,
                                                    str(result.source), audit))
            st.changed = True
        report.add("model", StepStatus.CHANGED, f"{spec.model_path}: {result.source}, {len(result.files)} files "
                                       f"({_mib(result.bytes)}) switched in")


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def _size(n: int | None) -> str:
    if n is None:
        return "an unknown amount"
    return f"{n / GIB:.1f} GiB" if n >= GIB else _mib(n)
