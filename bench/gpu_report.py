"""What the GPU benches share (fp8_hardware, bf16_hardware, bmm_gpu_speed, check_gpu_kernels): the report's
header, sections run so that one failing part does not lose the others' numbers, and the JSON file."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import torch


def header(**extra: object) -> dict:
    """Device (or the CPU dry run), torch version and any ``extra`` fields."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (dry run)"
    return {"device": device, "torch": torch.__version__, **extra}


def run_sections(report: dict, sections: Iterable[tuple[str, Callable[[], dict]]]) -> None:
    """Each (name, fn) into ``report[name]``, printed as it lands; an exception becomes that section's error."""
    for name, fn in sections:
        try:
            report[name] = fn()
        except Exception as exc:  # keep the other sections' numbers
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(name, json.dumps(report[name]), flush=True)


def finish(report: dict, out: str | None) -> int:
    """Write ``report`` to ``out`` as JSON when asked; the exit status."""
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    return 0
