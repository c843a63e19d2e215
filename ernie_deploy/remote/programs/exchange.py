"""Runs on the host: swaps paths argv[1] and argv[2] in one step, renameat2(RENAME_EXCHANGE) (Linux 3.15+,
glibc 2.28+). Exits 1 where the kernel or file system cannot, and the caller falls back to two renames."""

import ctypes
import os
import sys

libc = ctypes.CDLL(None, use_errno=True)
fn = getattr(libc, "renameat2", None)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
ok = fn is not None and fn(AT_FDCWD, os.fsencode(sys.argv[1]), AT_FDCWD, os.fsencode(sys.argv[2]), RENAME_EXCHANGE) == 0
sys.exit(0 if ok else 1)
