#!/usr/bin/env python3
"""Brings weight files into the page cache through a MADV_HUGEPAGE mapping.

Usage: warm_page_cache.py [--drop] FILE...

A fault in a MADV_HUGEPAGE range of a file mapping fills the page cache with
2 MiB folios, and any later 2 MiB-aligned mapping of the file (mlarun's, and
llama.cpp's where the kernel aligns it) maps them one page-table entry per
2 MiB instead of per 4 KiB. Pages already cached stay as they are: --drop
first evicts the file from the page cache (POSIX_FADV_DONTNEED), so the one
read that follows re-reads it from disk in large folios. Prints, per file,
how much of it this process saw on 2 MiB pages.
"""
import mmap
import os
import sys
import time


def warm(path, drop):
    fd = os.open(path, os.O_RDONLY)
    try:
        if drop:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    t0 = time.monotonic()
    view = memoryview(m)
    touched = sum(view[off] for off in range(0, size, 4096))
    seconds = time.monotonic() - t0
    real = os.path.realpath(path)
    pmd, current = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                current = fields[5] if len(fields) >= 6 else None
            elif fields and fields[0] == "FilePmdMapped:" and current == real:
                pmd += int(fields[1]) << 10
    view.release()
    m.close()
    print(f"{path}: {size >> 20} MiB, read in {seconds:.1f} s, {pmd >> 20} MiB of it on 2 MiB pages"
          f" (checksum {touched & 0xff})")


def main(argv):
    drop = "--drop" in argv
    files = [a for a in argv if a != "--drop"]
    if not files or any(a.startswith("-") for a in files):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for path in files:
        warm(path, drop)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
