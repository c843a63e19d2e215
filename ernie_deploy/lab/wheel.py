"""The simulator as a real Python package named `vllm`: a wheel per claimed version, and a wheel installed
into a host's venv the way pip lays it out.

Provisioning runs a real `python3 -m venv` and `pip install vllm==X` on lab hosts from a local wheelhouse,
so the installed package metadata the facts read is real. Hosts that start with vLLM already installed
get the same layout written straight into their tree before boot (pip on every host at every `lab up`
would cost seconds per host): a venv whose `bin/vllm` is the console script pip would write.
"""

from __future__ import annotations

import base64
import hashlib
import io
import re
import shutil
import zipfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent
SIM_DIR = PACKAGE_DIR / "lab" / "sim"
SIM_PACKAGE = "ernie_lab_sim"  # the simulator package's import name inside a lab host
CONSOLE_MODULE = f"{SIM_PACKAGE}.vllm_sim"
# Fixed timestamp: the same simulator source gives byte-identical wheels (and the same sha256).
_ZIP_TIME = (2020, 1, 1, 0, 0, 0)


def sim_files() -> list[tuple[str, bytes]]:
    """(path inside site-packages, content) of the simulator package, sorted."""
    out = []
    for f in sorted(SIM_DIR.glob("*.py")):
        out.append((f"{SIM_PACKAGE}/{f.name}", f.read_bytes()))
    return out


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def dist_info(version: str) -> list[tuple[str, bytes]]:
    """METADATA, WHEEL and entry_points.txt of the `vllm` distribution (PEP 427 / core metadata 2.1)."""
    info = f"vllm-{version}.dist-info"
    return [
        (f"{info}/METADATA", (f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                              "Summary: ernie-deploy lab simulator of vLLM's CLI and server (not vLLM)\n"
                              "Requires-Python: >=3.9\n").encode()),
        (f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: ernie-deploy-lab\nRoot-Is-Purelib: true\n"
                          b"Tag: py3-none-any\n"),
        (f"{info}/entry_points.txt", f"[console_scripts]\nvllm = {CONSOLE_MODULE}:main\n".encode()),
    ]


def build_wheel(version: str, out_dir: Path) -> Path:
    """`vllm-VERSION-py3-none-any.whl` in out_dir (rewritten only when its content changed)."""
    return _write_wheel("vllm", version, sim_files() + dist_info(version), out_dir)


def metadata_wheel(name: str, version: str, summary: str, requires: tuple[str, ...], out_dir: Path) -> Path:
    """A wheel that installs nothing but its metadata: a distribution name and version for pip and
    importlib.metadata to find, and the requirements it pulls in (docs/lab.md, real vLLM's packaging)."""
    info = f"{_dist_name(name)}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: {summary}\n" + \
        "".join(f"Requires-Dist: {r}\n" for r in requires)
    return _write_wheel(name, version, [
        (f"{info}/METADATA", metadata.encode()),
        (f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: ernie-deploy-lab\nRoot-Is-Purelib: true\n"
                          b"Tag: py3-none-any\n"),
    ], out_dir)


def _dist_name(name: str) -> str:
    """A distribution name as wheel file and dist-info names spell it (PEP 427: runs of -_. become _)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _write_wheel(name: str, version: str, files: list[tuple[str, bytes]], out_dir: Path) -> Path:
    if not re.fullmatch(r"[0-9][0-9A-Za-z.+]*", version):
        raise ValueError(f"not a wheel version: {version!r}")
    record = f"{_dist_name(name)}-{version}.dist-info/RECORD"
    lines = [f"{path},{_record_hash(data)},{len(data)}" for path, data in files] + [f"{record},,"]
    files = [*files, (record, ("\n".join(lines) + "\n").encode())]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path_in_wheel, data in files:
            entry = zipfile.ZipInfo(path_in_wheel, _ZIP_TIME)
            entry.external_attr = 0o644 << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(entry, data)
    path = out_dir / f"{_dist_name(name)}-{version}-py3-none-any.whl"
    out_dir.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_bytes() != buf.getvalue():
        path.write_bytes(buf.getvalue())
    return path


def build_wheelhouse(out_dir: Path, versions: set[str]) -> Path:
    """A find-links directory with one simulator wheel per version; wheels of other versions are removed."""
    keep = {build_wheel(v, out_dir).name for v in versions}
    for old in out_dir.glob("vllm-*.whl"):
        if old.name not in keep:
            old.unlink()
    return out_dir


def host_python(root: Path) -> str:
    """The `X.Y` of the host tree's python3 (its /usr/lib/pythonX.Y/os.py)."""
    found = sorted(p.parent.name for p in (root / "usr/lib").glob("python3.*/os.py"))
    if not found:
        raise FileNotFoundError(f"no python3 in {root}/usr/lib")
    return found[-1].removeprefix("python")


def console_script(venv: str) -> str:
    """What pip writes for a `vllm = ernie_lab_sim.vllm_sim:main` console script."""
    return (f"#!{venv}/bin/python3\n# -*- coding: utf-8 -*-\nimport re\nimport sys\n"
            f"from {CONSOLE_MODULE} import main\n"
            "if __name__ == '__main__':\n"
            "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
            "    sys.exit(main())\n")


def install_venv(root: Path, venv: str, version: str) -> None:
    """A venv at `venv` inside the host tree with the `vllm` simulator package installed, laid out as
    `python3 -m venv` and `pip install` would (pyvenv.cfg, bin/python3 → /usr/bin/python3, site-packages
    with the dist-info, the console script)."""
    py = host_python(root)
    top = root / venv.lstrip("/")
    if top.exists():
        shutil.rmtree(top)
    site = top / f"lib/python{py}/site-packages"
    site.mkdir(parents=True)
    (top / "lib64").symlink_to("lib")
    (top / "pyvenv.cfg").write_text(f"home = /usr/bin\ninclude-system-site-packages = false\nversion = {py}\n"
                                    f"executable = /usr/bin/python{py}\n")
    bin_dir = top / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to("/usr/bin/python3")
    (bin_dir / "python").symlink_to("python3")
    (bin_dir / f"python{py}").symlink_to("python3")
    write_package(site, version)
    script = bin_dir / "vllm"
    script.write_text(console_script(venv))
    script.chmod(0o755)


def write_package(site: Path, version: str) -> None:
    """The simulator package and its dist-info into a site-packages directory (replacing an older copy)."""
    pkg = site / SIM_PACKAGE
    if pkg.exists():
        shutil.rmtree(pkg)
    for old in site.glob("vllm-*.dist-info"):
        shutil.rmtree(old)
    for name, data in sim_files() + dist_info(version) + [(f"vllm-{version}.dist-info/INSTALLER", b"ernie-lab\n")]:
        path = site / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def refresh_venvs(root: Path) -> int:
    """Copy the current simulator source into every simulator venv on the host (pip-installed ones too), so
    a simulator edit reaches a running lab without reinstalling; returns how many were refreshed."""
    count = 0
    for pkg in (root / "opt").glob(f"**/site-packages/{SIM_PACKAGE}"):
        if pkg.is_dir() and not pkg.is_symlink():
            for name, data in sim_files():
                (pkg.parent / name).write_bytes(data)
            count += 1
    return count
