"""The host's matrix-product rates and kernel path. A trial's time follows the rates more than anything
in this code, so every trial reports them (`host/matmul_gflops_fp32`, `host/matmul_gflops_bf16`: one
thread of its CPU, or its GPU) and a run's time is read against another host's with them; benchmarks/
reads the same function. Its numbers follow the kernel path (`host/kernels`): one spec and seed give
the same metrics to the bit on one path, and another draw on another (docs/trial.md)."""

from __future__ import annotations

import platform
import statistics
import time

import torch


def matmul_tflops(device: torch.device, dtype=torch.bfloat16, n: int = 8192, repeats: int = 10) -> float:
    """The device's measured dense matmul rate (n x n x n, random data, the median of `repeats` after
    warm-up): the ceiling an MFU is read against, as this card runs in the same process."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e12


def host_rates(device: torch.device) -> dict[str, float]:
    """GFLOP/s of 1,024 x 1,024 products on `device` in fp32 and bf16 (on a CPU, with the threads the
    trial runs with), as a trial's metrics; about half a second on one core."""
    return {f"host/matmul_gflops_{name}": round(1000 * matmul_tflops(device, dtype, n=1024, repeats=5), 1)
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}


def kernels(device: torch.device) -> str:
    """The path a trial's arithmetic takes: the device, the kernels PyTorch dispatches to on it (a
    CPU's vector width, a GPU's architecture and CUDA) and PyTorch's version."""
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"cuda {p.name} sm_{p.major}{p.minor}, CUDA {torch.version.cuda}, torch {torch.__version__}"
    return f"cpu {torch.backends.cpu.get_cpu_capability()} {cpu_model()}, torch {torch.__version__}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()
