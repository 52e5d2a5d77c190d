"""What this installation of Kog is: the native backend built, the devices found, the versions."""

from __future__ import annotations

import platform
from typing import Any


def backend_info() -> dict[str, Any]:
    """Describe the build and the machine.

    Returns:
        A dict with ``version``, ``backend`` (cpu, cuda or rocm, as built), ``gpu_archs``,
        ``gpu_runtime``, ``compiler``, ``cpu_isa`` (the CPU kernels in use),
        ``cpu_isas_supported``, ``cpu_threads``, ``gpu_devices`` (a list, empty when none is
        visible), ``device`` (the device Kog will run on: ``"cpu"`` or ``"cuda:0"``) and the
        versions of Python, torch and numpy.
    """
    import numpy
    import torch

    from kog import __version__, _C

    info: dict[str, Any] = {"version": __version__}
    info.update(_C.build_info())
    info["gpu_devices"] = list(_C.gpu_devices())
    info["device"] = "cuda:0" if info["gpu_devices"] else "cpu"
    info["python"] = platform.python_version()
    info["torch"] = torch.__version__
    info["numpy"] = numpy.__version__
    info["machine"] = f"{platform.system()} {platform.machine()}"
    return info


def gpu_unavailable_reason(index: int | None = None) -> str | None:
    """Why Kog cannot run on GPU `index` (default: the current one) here, or None when it can."""
    import torch

    from kog import _C

    if not _C.has_gpu_backend:
        return (f"kog._C was built with KOG_BACKEND={_C.build_info()['backend']}; "
                f"install or rebuild kog with KOG_BACKEND=cuda or rocm")
    if not torch.cuda.is_available():
        return "torch sees no GPU (torch.cuda.is_available() is False)"
    if index is not None and index >= torch.cuda.device_count():
        return f"only {torch.cuda.device_count()} GPU(s) visible"
    return None


def format_backend_info(info: dict[str, Any]) -> str:
    """Render backend_info() as the aligned text `kog info` prints."""
    lines = []
    for key in ("version", "backend", "gpu_archs", "gpu_runtime", "compiler", "cpu_isa",
                "cpu_isas_supported", "cpu_threads", "device", "python", "torch", "numpy", "machine"):
        value = info.get(key)
        if isinstance(value, list):
            value = ", ".join(value)
        lines.append(f"{key:<20}{value if value not in (None, '') else '-'}")
    devices = info.get("gpu_devices") or []
    if not devices:
        lines.append(f"{'gpu_devices':<20}none found")
    for d in devices:
        mem_gib = d["total_memory"] / 2**30
        lines.append(
            f"{'gpu_devices':<20}[{d['index']}] {d['name']} ({d['arch']}, {mem_gib:.0f} GiB, "
            f"{d['multiprocessors']} compute units, warp {d['warp_size']})"
        )
    return "\n".join(lines)
