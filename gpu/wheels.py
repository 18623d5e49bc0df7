"""The wheels the GPU check carries: what `python -m study.train` and P5 import that a bare GPU
machine's image lacks, at the versions installed here, for that machine's Python
(`python -m gpu.check wheels`; docs/gpu.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

# what `python -m study.train` and P5 import that the GPU machine's image lacks (no Ray, MLflow or
# Optuna: nothing of the study level runs there), at the versions installed here
CARRIED = ["deepspeed", "hjson", "pydantic", "pydantic_core", "annotated_types", "typing_inspection",
           "typing_extensions"]
BUILT_HERE = {"deepspeed"}  # published as a source archive only: built into a pure-Python wheel here
# what the image has (its package list), as far as the carried wheels ask for it
ON_DEVICE = {"torch", "numpy", "pandas", "pyyaml", "psutil", "packaging", "tqdm", "einops", "msgpack", "ninja",
             "py-cpuinfo", "nvidia-ml-py", "matplotlib", "filelock", "typing-extensions"}
WHEEL_LIMIT = 64 * 2**20  # what travels with the working tree, wheels and code together
DEVICE_PYTHON = "3.12"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def normalized_name(name: str) -> str:
    return name.lower().replace("_", "-")


def build_wheels(folder: str) -> list[Path]:
    """Download (or build) the carried packages at this environment's versions, for the GPU
    machine's Python, into `folder`; returns the wheels."""
    os.makedirs(folder, exist_ok=True)
    pins = [f"{name}=={metadata.version(name)}" for name in CARRIED if name not in BUILT_HERE]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", DEVICE_PYTHON, "--implementation", "cp", *platforms, "-d", folder, *pins],
                   check=True)
    for name in BUILT_HERE:  # its build imports torch: this environment's, not a fresh download
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", folder, f"{name}=={metadata.version(name)}"], check=True)
    return sorted(Path(folder).glob("*.whl"))


def wheel_requirements(wheel: Path) -> list[str]:
    """The package names a wheel requires (extras left out)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    names = []
    for line in lines:
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            names.append(normalized_name(re.match(r"[A-Za-z0-9._-]+", line.split(":", 1)[1].strip()).group(0)))
    return names


def unmet_requirements(wheels: list[Path]) -> dict[str, list[str]]:
    """Per wheel, what it requires that neither travels nor is on the GPU machine."""
    carried = {normalized_name(w.name.split("-")[0]) for w in wheels}
    out = {}
    for w in wheels:
        missing = [r for r in wheel_requirements(w) if r not in carried and r not in ON_DEVICE]
        if missing:
            out[w.name] = missing
    return out
