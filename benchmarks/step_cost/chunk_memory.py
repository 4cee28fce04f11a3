"""What one sample of a per-sample-gradient chunk costs on CUDA, against its gradient alone.

    python benchmarks/step_cost/chunk_memory.py benchmarks/step_cost/chunk_memory_cuda.json   # needs a GPU

For three model/trainable-set/input-size cases (the product backbone as the utility tables and the
step-cost benchmark train it, and the tiny sweep backbone): the chunk sized by the gradients alone
(``auto_chunk_size``), the chunk measured on the model (``measured_chunk_size``, what training uses),
how long that measurement took, and the allocator's peak per sample of a 32-sample chunk of the
per-unit path (gradients, unit sums and activations) beside the size of one gradient. ``rows``
caps both chunks (a step's fixed row count in the benchmark that trains it).
"""
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from fedpose.config import ModelConfig
from fedpose.model import build_model
from fedpose.privacy import per_sample as ps


def main() -> int:
    device = torch.device("cuda", 0)
    out = []
    for backbone, scenario, size, rows in [("tiny_vit_5m_224", "biases_norms", (128, 96), 228),
                                           ("tiny_vit_5m_224", "finetune", (256, 192), 64),
                                           ("tiny_vit_test", "biases_norms", (128, 96), 64)]:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build_model(ModelConfig(backbone=backbone, scenario=scenario), size).to(device)
        p = sum(x.numel() for x in model.trainable_parameters().values())
        gradients_only = ps.auto_chunk_size(device, p, rows)
        started = time.perf_counter()
        measured = ps.measured_chunk_size(model, device, rows)
        probe_s = time.perf_counter() - started
        n = min(32, measured)
        per_sample_mib = ps.chunk_peak_bytes(model, device, n)[0] / n / 2**20
        row = dict(backbone=backbone, scenario=scenario, size=size, rows=rows, p=p, gradients_only_chunk=gradients_only,
                   measured_chunk=measured, probe_seconds=round(probe_s, 2), chunk_peak_mib_per_sample_at=n,
                   chunk_peak_mib_per_sample=round(per_sample_mib, 2), gradient_mib=round(4 * p / 2**20, 3),
                   available_gib=round(ps.available_device_memory(device) / 2**30, 1))
        print(json.dumps(row), flush=True)
        out.append(row)
        del model
        torch.cuda.empty_cache()
    Path(sys.argv[1]).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
