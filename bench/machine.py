"""The one line every benchmark prints above its tables: what it ran on.

A benchmark's numbers mean little without the machine (cores, CPU model,
Python); on a shared machine the reader also needs to know that others ran.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model(cpuinfo: str) -> str:
    """The first ``model name`` of a /proc/cpuinfo text, or "" (ARM kernels may not give one)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name" and value.strip():
            return " ".join(value.split())
    return ""


def machine_line(cpuinfo_path: Path = Path("/proc/cpuinfo")) -> str:
    """``machine: 2 cores (AMD EPYC 7B13), Linux 6.1 x86_64, Python 3.11.7``."""
    try:
        model = cpu_model(cpuinfo_path.read_text())
    except OSError:
        model = ""
    model = model or platform.processor() or "unknown CPU"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    total = os.cpu_count()
    cores = f"{usable} cores" if usable == total else f"{usable} of {total} cores"
    return (f"machine: {cores} ({model}), {platform.system()} {platform.release()} {platform.machine()}, "
            f"Python {platform.python_version()}")
