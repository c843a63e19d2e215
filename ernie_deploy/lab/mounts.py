"""Removing directory trees that may still have file systems mounted inside them.

debootstrap mounts /proc and /sys (and may bind /dev) into the tree it builds, and each lab host's root
is an overlay mount; deleting such a tree without unmounting first would walk into (and delete from)
whatever is mounted there.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from ernie_deploy.errors import DeployError


def mounted_under(directory: Path) -> list[Path]:
    """Mount points at or below `directory`, deepest first (the order to unmount them)."""
    prefix = str(directory.resolve())
    points: list[Path] = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            point = line.split()[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                points.append(Path(point))
    return sorted(points, key=lambda p: len(p.parts), reverse=True)


def unmount_and_remove(directory: Path) -> None:
    """Lazily unmount everything inside (a busy mount never blocks us), then delete the tree."""
    if not directory.exists():
        return
    for point in mounted_under(directory):
        subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)
    if mounted_under(directory):
        raise DeployError("cannot unmount what is mounted inside", where=str(directory),
                          hint=f"run: umount -R -l {directory}; then delete it")
    shutil.rmtree(directory)
