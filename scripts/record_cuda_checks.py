"""Record what the stored GPU run measured against the predictions, for the "checked on" sentence of every prediction.

    python scripts/record_cuda_checks.py   # -> anatomy_helpers/prediction/cuda_checks.json (seconds, on a CPU)

Reads the GPU run the repository keeps, never a figure typed in:

* ``anatomy_helpers/lessons/gpu_reference/first_steps.json`` (``scripts/record_gpu_reference.py``): the default step
  from a fresh process, ``max_memory_allocated`` per step in bytes, with the GPU and torch it ran on;
* ``docs/gpu_outputs/06_prediction.ipynb`` (``scripts/gpu_check.py --out docs/gpu_outputs``): lesson 06's GPU cell,
  the default step after a warm-up step, ``max_memory_allocated`` against the prediction (MiB, as printed);
* ``docs/gpu_outputs/05_checkpointing.ipynb``: lesson 05's GPU cell, each policy's tracked step-2 peak against
  ``max_memory_allocated`` (MiB, as printed);
* the GPU and torch of the ``docs/gpu_outputs`` run: the instructor guide's line on them.

For the default step it adds today's prediction for that GPU's compute capability
(``lessons.lesson06_prediction.default_step_on_gpu``: the tensors' peak and the allocator simulator's peak of
allocated bytes); tests/test_cuda_rules.py checks that the file matches these sources and today's prediction. Run it
again after ``gpu_check.py`` or ``record_gpu_reference.py`` records a new run, or when a rule changes the prediction.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a clone without installing the package

from anatomy_helpers.core.units import MiB  # noqa: E402
from anatomy_helpers.lessons.lesson06_prediction import default_step_on_gpu  # noqa: E402
from anatomy_helpers.prediction.cuda_checks import CUDA_CHECKS  # noqa: E402
from anatomy_helpers.prediction.devices import DEVICES  # noqa: E402
from anatomy_helpers.prediction.snapshot import GPU_REFERENCE  # noqa: E402

GPU_OUTPUTS = ROOT / "docs" / "gpu_outputs"
GUIDE = ROOT / "docs" / "instructor_guide.md"


def outputs(notebook: Path) -> list[str]:
    """The text outputs of each code cell of ``notebook``, one string per cell."""
    cells = json.loads(notebook.read_text())["cells"]
    texts = []
    for cell in cells:
        if cell["cell_type"] == "code":
            texts.append("".join("".join(o.get("text", "")) for o in cell.get("outputs", [])))
    return texts


def one_match(pattern: str, texts: list[str], where: str) -> re.Match:
    """The one match of ``pattern`` in the texts; SystemExit naming ``where`` if there is none or several."""
    found = [m for t in texts for m in re.finditer(pattern, t)]
    if len(found) != 1:
        raise SystemExit(f"{where}: expected one match of {pattern!r}, found {len(found)}")
    return found[0]


def capability_of(gpu: str) -> list[int]:
    """The compute capability of the named GPU ("NVIDIA H200" -> [9, 0]), from devices.DEVICES."""
    known = [d for d in DEVICES.values() if gpu.removeprefix("NVIDIA ").startswith(d.name.split()[0])]
    if len({d.capability for d in known}) != 1:
        raise SystemExit(f"no one compute capability known for {gpu!r}")
    return list(known[0].capability)


def mib(nbytes: int) -> float:
    return round(nbytes / MiB, 2)


def main() -> int:
    reference = json.loads(GPU_REFERENCE.with_suffix(".json").read_text())
    gpu, torch_version = reference["gpu"], reference["torch"]
    capability = capability_of(gpu)
    fresh = default_step_on_gpu(tuple(capability), warm=False)
    first_steps = {
        "source": "anatomy_helpers/lessons/gpu_reference/first_steps.json",
        "what": "the default step from a fresh process (cuBLAS workspaces made in it)",
        "gpu": gpu,
        "torch": torch_version,
        "capability": capability,
        "against": "prediction",
        "rows": [
            {
                "label": f"step {peak['step']}",
                "measured_mib": mib(peak["max_allocated"]),
                "predicted_mib": mib(fresh[peak["step"] - 1][0]),
                "simulated_mib": mib(fresh[peak["step"] - 1][1]),
            }
            for peak in reference["peaks"]
            if peak["step"] <= len(fresh)
        ],
    }

    guide = one_match(r"on one (NVIDIA [^\n]+)\nwith torch (\S+)", [GUIDE.read_text()], str(GUIDE))
    run_gpu, run_torch = guide.group(1), guide.group(2)
    warm = default_step_on_gpu(tuple(capability_of(run_gpu)), warm=True)
    nb06 = outputs(GPU_OUTPUTS / "06_prediction.ipynb")
    measured = one_match(r"real: max_memory_allocated ([\d.]+) MiB", nb06, "06_prediction.ipynb")
    printed = one_match(r"predicted \(dry run\): peak ([\d.]+) MiB of tensors", nb06, "06_prediction.ipynb")
    lesson06 = {
        "source": "docs/gpu_outputs/06_prediction.ipynb",
        "what": "lesson 06: the default step after a warm-up step (cuBLAS workspaces made before it)",
        "gpu": run_gpu,
        "torch": run_torch,
        "capability": capability_of(run_gpu),
        "against": "prediction",
        "rows": [
            {
                "label": "steps 1-2",
                "measured_mib": float(measured.group(1)),
                "predicted_mib": mib(max(t for t, _ in warm)),
                "simulated_mib": mib(max(a for _, a in warm)),
                "printed_prediction_mib": float(printed.group(1)),  # what the run itself printed
            }
        ],
    }

    nb05 = outputs(GPU_OUTPUTS / "05_checkpointing.ipynb")
    table = one_match(r"policy +tracked +max_memory_allocated[^\n]*\n-+\n((?:.+\n?)+)", nb05, "05_checkpointing.ipynb")
    rows = []
    for line in table.group(1).strip().splitlines():
        *label, tracked, allocated = line.split()
        rows.append({"label": " ".join(label), "measured_mib": float(allocated), "predicted_mib": float(tracked)})
    lesson05 = {
        "source": "docs/gpu_outputs/05_checkpointing.ipynb",
        "what": "lesson 05: each policy's step-2 peak, tracked on the GPU, after the lesson's earlier GPU cells",
        "gpu": run_gpu,
        "torch": run_torch,
        "capability": capability_of(run_gpu),
        "against": "tracked",
        "rows": rows,
    }
    record = {"written_by": "scripts/record_cuda_checks.py", "unit": "MiB", "runs": [first_steps, lesson06, lesson05]}
    CUDA_CHECKS.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {CUDA_CHECKS}: {sum(len(r['rows']) for r in record['runs'])} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
