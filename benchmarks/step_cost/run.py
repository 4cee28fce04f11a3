"""Seconds per training step for every privacy mechanism, relative to non-private training.

    python benchmarks/step_cost/run.py                    # 256×192, batch 16, tiny_vit_5m_224, finetune
    python benchmarks/step_cost/run.py --size 128 96 --repeats 3
    python benchmarks/step_cost/run.py --noise-only        # noise generation vs a few dpsgd steps → noise_cost.json
    python benchmarks/step_cost/run.py --device cuda --batch 64   # on a GPU → results_cuda_batch64.json

Writes benchmarks/step_cost/results.json (earlier runs worth keeping are moved to history/); with
``--device cuda``, results_cuda_batch<B>.json (and noise_cost_cuda.json). Method:
* one model (random weights: speed does not depend on them), one fixed batch of exactly B
  samples, so every mechanism does the same work (fdp, fpdp and maskdp also take their public
  view's gradient on a public sample of B other rows, as in training); Poisson batch-size
  variation is not timed;
* mechanisms are timed round-robin (none, dpsgd, pdp, ... then again) and the median per
  mechanism is reported, so slow phases of a shared machine hit all of them alike; the ratio
  uses the non-private median of the same run;
* basis refresh (m public samples → k vectors) and the projection V(Vᵀg) are timed separately;
  each projecting engine refreshes twice before the timed steps: the first ("cold") maps the
  engine's basis workspace, the second ("warm") is what every later refresh of a run costs;
* noise generation, for the model's p noise coordinates: ``SecureNoise`` (the default: Box–Muller
  on an AES-256-CTR keystream keyed from os.urandom) and ``InsecureSeededNoise`` (seeded torch
  generator, tests only), each as a share of the median dpsgd step of the same run (dpsgd draws
  from SecureNoise). ``--noise-only`` times just that and a few dpsgd steps and writes
  ``noise_cost.json``;
* peak memory: each mechanism in a fresh subprocess doing 2 steps (basis refresh included), with
  fedpose's allocator settings and with glibc's defaults (FEDPOSE_MALLOC_TUNING=0),
  the process's VmHWM from /proc/self/status. Not ru_maxrss: Linux carries it over from the
  forking parent across exec, so every probe would report this (large) process's peak.
* on CUDA (``--device cuda``): the device's name and memory are recorded; every timed step and
  noise draw ends with ``torch.cuda.synchronize`` (CUDA queues work asynchronously); each
  mechanism's peak GPU memory (``torch.cuda.max_memory_allocated`` of the fresh probe process,
  weights and basis included) is reported with its ratio to non-private, and images/s beside
  s/step; the noise comparison adds the two ways of getting secure noise onto the GPU: ChaCha20
  computed on the device (what fedpose does) and AES-CTR on the host plus the copy; TF32 matmuls
  are on, as in training (``fedpose.runtime.configure_device``); the glibc-defaults probe is CPU-only.
The load average at start and end is recorded: on a shared 2-core machine numbers are noisy.
So is the hypervisor's *steal* over the timed steps (share of this VM's CPU time that its host
gave to others, from /proc/stat): wall-clock steps slow down by about that much, unevenly. Each
step's process CPU time is recorded beside its wall time; stolen time is not counted in it, so
the CPU-time ratios show the work itself (they are not what the goals are stated in).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from fedpose.config import ModelConfig, PrivacyConfig
from fedpose.io import atomic_write_json
from fedpose.model import build_model
from fedpose.privacy.engine import PUBLIC_SAMPLE_KEY, build_engine, collate
from fedpose.privacy.mechanisms import MECHANISM_NAMES
from fedpose.privacy.noise import InsecureSeededNoise, SecureNoise
from fedpose.runtime import configure_device, cpu_model, describe_device, resolve_device, synchronize

HERE = Path(__file__).resolve().parent
MECHANISMS = MECHANISM_NAMES
#: timed noise draws per source (after one warm-up draw)
NOISE_REPEATS = 11
GOALS = {"dpsgd_ratio_max": 1.15, "fpdp_ratio_max": 2.2, "projection_share_max": 0.05, "refresh_seconds_max": 15.0}
#: issue 18's goals on a GPU (256×192, finetune; the dpsgd ratio is stated at batch 64)
GOALS_CUDA = {"dpsgd_ratio_max_at_batch_64": 1.3, "fpdp_ratio_max": 2.1, "projection_share_max": 0.03,
              "refresh_seconds_max_m100_k50": 2.0}


class RandomPoseSet(torch.utils.data.Dataset):
    def __init__(self, n: int, size: tuple[int, int], offset: int = 0) -> None:
        self.n, self.size, self.offset = n, size, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.offset + i)
        h, w = self.size
        image = torch.randn(3, h, w, generator=g)
        return {
            "image": image,
            # stands in for FDP's ψ(x) (16×16 block means; the dataset computes the real one): speed does not depend on it
            "public_image": torch.nn.functional.interpolate(torch.nn.functional.avg_pool2d(image[None], 16), size=(h, w))[0],
            "joints": torch.rand(16, 2, generator=g) * torch.tensor([w, h]),
            "weight": torch.ones(16),
            "index": i,
            "face_box": torch.tensor([w * 0.35, h * 0.05, w * 0.65, h * 0.25]),
            # MaskDP's private region: every head box of the image (one person here)
            "head_boxes": torch.tensor([[w * 0.35, h * 0.05, w * 0.65, h * 0.25]]),
            "head_count": torch.tensor(1),
            "private_reach": torch.tensor([1.5, 1.5]),  # the crop is its own source: bilinear support + half a pixel
        }


def fixed_batch(engine, rows: RandomPoseSet, batch_size: int) -> dict:
    """Exactly B private rows; a mechanism with a public view also gets its own public sample of B
    other rows (the engine takes ψ's noise-free gradient on a sample drawn apart from the private
    one, as :meth:`GradientEngine.batches` does), so its step does that work too."""
    batch = collate([rows[i] for i in range(batch_size)])
    if engine.mechanism.public_view is not None:
        batch[PUBLIC_SAMPLE_KEY] = collate([rows[i] for i in range(batch_size, 2 * batch_size)])
    return batch


def privacy_config(mechanism: str, k: int, m: int) -> PrivacyConfig:
    if mechanism == "none":
        return PrivacyConfig()
    return PrivacyConfig(
        mechanism=mechanism, noise_multiplier=1.0, max_grad_norm=0.1, delta=4e-5,
        basis={"k": k, "public_samples": m, "refresh_every": 10**9},
    )


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def noise_seconds(p: int, device: torch.device, repeats: int = NOISE_REPEATS) -> dict[str, list[float]]:
    """Seconds to draw N(0, I_p) onto ``device``, ``repeats`` times per source, after one untimed
    warm-up draw each. On the CPU: the secure and the seeded source. On a GPU: the secure source on
    the device (ChaCha20 there, what the engine does), the secure source on the host plus the copy
    (AES-CTR, the alternative), and the seeded source (host draw plus copy)."""
    secure, seeded = SecureNoise(), InsecureSeededNoise(0)
    if device.type == "cpu":
        sources = {"secure_aes_ctr_box_muller": lambda: secure.normal(p, 1.0),
                   "insecure_seeded_torch": lambda: seeded.normal(p, 1.0)}
    else:
        sources = {"secure_chacha20_on_device": lambda: secure.normal(p, 1.0, device=device),
                   "secure_aes_ctr_on_host_plus_copy": lambda: secure.normal(p, 1.0).to(device),
                   "insecure_seeded_torch_plus_copy": lambda: seeded.normal(p, 1.0, device=device)}
    runs: dict[str, list[float]] = {label: [] for label in sources}
    for draw in sources.values():
        draw()
    synchronize(device)
    for _ in range(repeats):  # interleaved, so a slow phase of a shared machine hits both
        for label, draw in sources.items():
            started = time.perf_counter()
            draw()
            synchronize(device)
            runs[label].append(time.perf_counter() - started)
    return runs


def noise_summary(noise: dict[str, list[float]], dpsgd_step: float | None) -> dict[str, dict]:
    """Median seconds per source, and as a percentage of the median dpsgd step."""
    medians = {label: statistics.median(t) for label, t in noise.items()}
    return {
        "noise_seconds_for_p_coordinates": medians,
        "noise_percent_of_dpsgd_step": {label: (100.0 * m / dpsgd_step if dpsgd_step else None) for label, m in medians.items()},
        "noise_all_seconds": noise,
    }


def conditions(args: argparse.Namespace, p: int, started_load: list[float]) -> dict:
    import cryptography

    info = {
        "backbone": args.backbone, "scenario": "finetune", "input_size": list(args.size), "batch_size": args.batch,
        "trainable_parameters": p, "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "cryptography": cryptography.__version__, "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
        "device": describe_device(args.device), "load_average_start": started_load, "load_average_end": load_average(),
    }
    if args.device.type == "cuda":
        props = torch.cuda.get_device_properties(args.device)
        info.update(gpu_name=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 2), cuda=torch.version.cuda,
                    tf32_matmul=torch.backends.cuda.matmul.allow_tf32, tf32_cudnn=torch.backends.cudnn.allow_tf32)
    return info


def timed_step(engine, model, batch: dict, device: torch.device) -> tuple[dict, float, float]:
    """(metrics, wall seconds, process CPU seconds) of one engine step, the device's queue drained."""
    started, cpu_started = time.perf_counter(), time.process_time()
    metrics = engine.step(model, batch)
    synchronize(device)
    return metrics, time.perf_counter() - started, time.process_time() - cpu_started


def noise_only(args: argparse.Namespace) -> int:
    """Noise generation for the model's p, against a few dpsgd steps of the same model and batch."""
    started_load = load_average()
    model = make_model(args)
    p = model.num_trainable()
    private = RandomPoseSet(4 * args.batch, tuple(args.size))
    batch = collate([private[i] for i in range(args.batch)])
    engine = build_engine(privacy_config("dpsgd", args.k, args.public_samples), model, len(private), args.batch, 10, None, 0)
    print(f"p = {p}, input {tuple(args.size)}, batch {args.batch}, device {describe_device(args.device)}, "
          f"torch threads {torch.get_num_threads()}, load {started_load}")
    noise = noise_seconds(p, args.device)
    timed_step(engine, model, batch, args.device)  # warm-up
    steps = []
    for _ in range(args.repeats):
        steps.append(timed_step(engine, model, batch, args.device)[1])
        print(f"dpsgd step {steps[-1]:.3f} s")
    for label, seconds in noise_seconds(p, args.device).items():  # again after the steps: the machine's load drifts
        noise[label] += seconds
    dpsgd = statistics.median(steps)
    results = {
        "conditions": {**conditions(args, p, started_load), "timed_dpsgd_steps": args.repeats,
                       "noise_draws_per_source": 2 * NOISE_REPEATS,
                       "note": "noise timed before and after the dpsgd steps, interleaved between the two sources"},
        "dpsgd_seconds_per_step": dpsgd,
        "all_dpsgd_step_seconds": steps,
        **noise_summary(noise, dpsgd),
    }
    atomic_write_json(args.out, results)
    print(json.dumps({k: results[k] for k in ("dpsgd_seconds_per_step", "noise_seconds_for_p_coordinates", "noise_percent_of_dpsgd_step")}, indent=1))
    return 0


def cpu_jiffies() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return fields[7], sum(fields[:8])  # user nice system idle iowait irq softirq steal


def make_model(args: argparse.Namespace):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_model(ModelConfig(backbone=args.backbone, scenario="finetune"), tuple(args.size)).to(args.device)


def peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def memory_probe(args: argparse.Namespace) -> int:
    """Subprocess mode: 2 steps of one mechanism, print peak RSS (and on CUDA peak GPU memory) in MiB."""
    model = make_model(args)
    size = tuple(args.size)
    private, public = RandomPoseSet(4 * args.batch, size), RandomPoseSet(args.public_samples, size, 10_000)
    engine = build_engine(privacy_config(args.memory_probe, args.k, args.public_samples), model, len(private), args.batch, 10, public, 0)
    batch = fixed_batch(engine, private, args.batch)
    for _ in range(2):
        engine.step(model, batch)
    peaks = {"peak_rss_mib": peak_rss_mib()}
    if args.device.type == "cuda":
        synchronize(args.device)
        peaks["peak_gpu_memory_mib"] = torch.cuda.max_memory_allocated(args.device) / 2**20
    print(json.dumps(peaks))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, nargs=2, default=(256, 192), metavar=("H", "W"))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--backbone", default="tiny_vit_5m_224")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per mechanism (after 1 warm-up)")
    parser.add_argument("--k", type=int, default=50)
    parser.add_argument("--public-samples", type=int, default=100)
    parser.add_argument("--mechanisms", nargs="+", default=list(MECHANISMS), choices=MECHANISMS)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU only)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--noise-only", action="store_true",
                        help="time only noise generation for the model's p and --repeats dpsgd steps (writes noise_cost.json)")
    parser.add_argument("--out", type=Path, default=None, help="default: results.json, or noise_cost.json with --noise-only (beside this script)")
    parser.add_argument("--memory-probe", choices=MECHANISMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.device = resolve_device(args.device, "--device")
    cuda = args.device.type == "cuda"
    if args.noise_only:
        default_out = "noise_cost_cuda.json" if cuda else "noise_cost.json"
    else:
        default_out = f"results_cuda_batch{args.batch}.json" if cuda else "results.json"
    args.out = args.out or HERE / default_out
    configure_device(args.device, args.threads)
    if args.memory_probe:
        return memory_probe(args)
    if args.noise_only:
        return noise_only(args)

    size = tuple(args.size)
    started_load = load_average()
    model = make_model(args)
    p = model.num_trainable()
    private = RandomPoseSet(4 * args.batch, size)
    public = RandomPoseSet(args.public_samples, size, 10_000)
    engines = {name: build_engine(privacy_config(name, args.k, args.public_samples), model, len(private), args.batch, 10, public, 0)
               for name in args.mechanisms}
    batches = {name: fixed_batch(engine, private, args.batch) for name, engine in engines.items()}

    print(f"p = {p} trainable parameters, input {size}, batch {args.batch}, device {describe_device(args.device)}, "
          f"torch threads {torch.get_num_threads()}, load {started_load}")
    refresh_seconds: dict[str, list[float]] = {"cold": [], "warm": []}
    for name, engine in engines.items():  # cold + warm refresh per projecting engine; also the warm-up step
        if engine.mechanism.projects:
            for kind in ("cold", "warm"):
                refresh_seconds[kind].append(engine.refresh_basis(model))
                print(f"basis refresh ({name}, {kind}): {refresh_seconds[kind][-1]:.2f} s (m = {args.public_samples}, k = {args.k})")
        timed_step(engine, model, batches[name], args.device)

    times: dict[str, list[float]] = {name: [] for name in engines}
    cpu_times: dict[str, list[float]] = {name: [] for name in engines}
    projection: list[float] = []
    steal_start, total_start = cpu_jiffies()
    for rep in range(args.repeats):
        for name, engine in engines.items():
            metrics, seconds, cpu_seconds = timed_step(engine, model, batches[name], args.device)
            times[name].append(seconds)
            cpu_times[name].append(cpu_seconds)
            if "projection_seconds" in metrics:
                projection.append(metrics["projection_seconds"])
        print(f"repeat {rep + 1}/{args.repeats}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()))

    steal_end, total_end = cpu_jiffies()
    steal_share = (steal_end - steal_start) / max(1, total_end - total_start)
    noise = noise_seconds(p, args.device)

    medians = {name: statistics.median(t) for name, t in times.items()}
    cpu_medians = {name: statistics.median(t) for name, t in cpu_times.items()}
    base, cpu_base = medians.get("none"), cpu_medians.get("none")
    results: dict = {
        "conditions": {
            **conditions(args, p, started_load), "timed_steps_per_mechanism": args.repeats, "basis_k": args.k,
            "public_samples_m": args.public_samples, "steal_share_during_timed_steps": round(steal_share, 4),
            "note": "medians of round-robin timings; see the load averages for how busy the machine was",
        },
        "seconds_per_step": medians,
        "images_per_second": {n: args.batch / m for n, m in medians.items()},
        "all_step_seconds": times,
        "ratio_to_non_private": {n: (m / base if base else None) for n, m in medians.items()},
        "cpu_seconds_per_step": cpu_medians,
        "all_step_cpu_seconds": cpu_times,
        "cpu_ratio_to_non_private": {n: (m / cpu_base if cpu_base else None) for n, m in cpu_medians.items()},
        "basis_refresh_seconds": refresh_seconds,
        "basis_refresh_warm_median": statistics.median(refresh_seconds["warm"]) if refresh_seconds["warm"] else None,
        "projection_seconds_median": statistics.median(projection) if projection else None,
        "projection_share_of_pdp_step": (statistics.median(projection) / medians["pdp"]) if projection and "pdp" in medians else None,
        **noise_summary(noise, medians.get("dpsgd")),
        "goals": GOALS_CUDA if cuda else GOALS,
    }
    if not args.skip_memory:
        # on CUDA the host allocator comparison is beside the point: one probe per mechanism, GPU peak included
        for key, tuning in (("peak_rss_mib", "1"),) if cuda else (("peak_rss_mib", "1"), ("peak_rss_mib_glibc_defaults", "0")):
            peaks, gpu_peaks = {}, {}
            for name in args.mechanisms:
                cmd = [sys.executable, __file__, "--memory-probe", name, "--size", *map(str, size), "--batch", str(args.batch),
                       "--backbone", args.backbone, "--k", str(args.k), "--public-samples", str(args.public_samples),
                       "--device", str(args.device)]
                out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "FEDPOSE_MALLOC_TUNING": tuning})
                probe = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
                peaks[name] = probe["peak_rss_mib"] if probe else f"failed: {out.stderr[-300:]}"
                if probe and "peak_gpu_memory_mib" in probe:
                    gpu_peaks[name] = probe["peak_gpu_memory_mib"]
                print(f"{key} {name}: {peaks[name]}" + (f", GPU {gpu_peaks[name]:.0f} MiB" if name in gpu_peaks else ""))
            results[key] = peaks
            if gpu_peaks:
                results["peak_gpu_memory_mib"] = gpu_peaks
                gpu_base = gpu_peaks.get("none")
                results["peak_gpu_memory_ratio_to_non_private"] = {n: (m / gpu_base if gpu_base else None) for n, m in gpu_peaks.items()}
    atomic_write_json(args.out, results)
    print(f"steal during the timed steps: {steal_share:.1%} of CPU time")
    print(json.dumps({k: results[k] for k in ("seconds_per_step", "images_per_second", "ratio_to_non_private", "cpu_ratio_to_non_private", "basis_refresh_seconds",
                                              "projection_seconds_median", "noise_seconds_for_p_coordinates",
                                              "noise_percent_of_dpsgd_step")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
