"""Devices: the device setting and its resolver, and every mechanism on CUDA with the CPU's guarantees.

The CPU tests always run. The CUDA tests run only where ``torch.cuda.is_available()``; most are
parametrized over ("cpu", "cuda") so their own logic is exercised on every machine, and the
CPU↔CUDA comparisons take the CPU as the reference. CUDA comparisons switch TF32 off (the
training entry points switch it on): float32 tolerances then hold on both devices.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats

from fedpose.config import ConfigError, ModelConfig, PrivacyConfig, RunConfig, load_config
from fedpose.federation.config import CoordinatorConfig
from fedpose.model import build_model
from fedpose.privacy import per_sample
from fedpose.privacy.chacha20 import keystream_words
from fedpose.privacy.engine import build_engine, collate
from fedpose.privacy.noise import SECURE_TAIL_BOUND_SIGMAS, SecureNoise, chacha20_normal
from fedpose.privacy.per_sample import (
    DEFAULT_CHUNK_SIZE,
    auto_chunk_size,
    chunk_size_from_probe,
    clip_factors,
    clipped_gradient_sum,
    flatten,
    frozen_features,
    measured_chunk_size,
    per_sample_gradients,
    per_sample_norms,
)
from fedpose.privacy.projection import ORTHONORMAL_TOLERANCE
from fedpose.runtime import DeviceOutOfMemory, DeviceUnavailable, describe_device, out_of_memory_hint, resolve_device
from fresh_draws import pvalue_of_two_draws

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
#: the device under test (the CPU run checks the test itself; the CUDA run checks the device)
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=requires_cuda)]
MECHANISMS = ("none", "dpsgd", "pdp", "fdp", "fpdp", "maskdp")
SIZE = (64, 64)


# -- the setting and its resolver (CPU) -----------------------------------------------------------------
def _cuda_visible(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_auto_is_cuda_when_available_else_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda_visible(monkeypatch, 0)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    _cuda_visible(monkeypatch, 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


def test_cuda_without_cuda_is_an_error_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda_visible(monkeypatch, 0)
    for setting in ("cuda", "cuda:0"):
        with pytest.raises(DeviceUnavailable, match=rf"train.device = '{setting}': CUDA is not available here .*\"cpu\""):
            resolve_device(setting, "train.device")
    with pytest.raises(DeviceUnavailable, match="coordinator.device"):
        resolve_device("cuda", "coordinator.device")
    _cuda_visible(monkeypatch, 1)
    with pytest.raises(DeviceUnavailable, match=r"train.device = 'cuda:3': only 1 CUDA device\(s\) visible"):
        resolve_device("cuda:3", "train.device")
    with pytest.raises(ConfigError, match="--device = 'gpu': must be 'auto'"):
        resolve_device("gpu", "--device")


def test_the_device_setting_is_validated_in_the_configs() -> None:
    for value in ("auto", "cpu", "cuda", "cuda:1"):
        assert load_config(None, [f'train.device="{value}"']).train.device == value
        assert CoordinatorConfig(device=value).device == value
    assert RunConfig().train.device == "auto" and CoordinatorConfig().device == "auto"
    for value in ("gpu", "cuda:", "cuda:x", "CPU0"):
        with pytest.raises(ConfigError, match=r"train.device: Value error, must be 'auto' \(CUDA when available"):
            load_config(None, [f'train.device="{value}"'])
    with pytest.raises(ConfigError, match="train.chunk_size"):
        load_config(None, ["train.chunk_size=0"])


def test_describe_device_says_where_it_ran() -> None:
    assert describe_device(torch.device("cpu")).startswith("cpu (")


def test_a_site_without_the_configured_gpu_fails_before_any_spend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """train.device = "cuda" at a site with no GPU: a typed error reply, nothing spent, no data read;
    the reason in the site's log (not in a file of a state that did not exist yet)."""
    from fedpose.federation.config import SiteConfig
    from fedpose.federation.local_training import run_site_round

    _cuda_visible(monkeypatch, 0)
    site = SiteConfig.model_validate({
        "site_id": "site-1", "data": {"train": str(tmp_path / "no-such-data")},
        "state_dir": str(tmp_path / "state"), "eps_max": 10.0, "local_steps": 2, "train": {"device": "cuda"},
        "privacy": {"mechanism": "dpsgd", "noise_multiplier": 1.0, "sample_rate": 0.25, "unit": "record"},
    })
    reply = run_site_round(site, "run", 1, {}, {}, 2).reply
    assert (reply.status, reply.error_class) == ("error", "DeviceUnavailable")
    assert reply.privacy is None or reply.privacy.rounds_spent == 0
    budget = tmp_path / "state" / "budget.json"
    assert not budget.exists() or not [e for e in json.loads(budget.read_text())["payload"]["entries"] if e["status"] == "spent"]
    assert "site 'site-1' train.device = 'cuda'" in caplog.text
    assert not (tmp_path / "state" / "rounds.jsonl").exists()


def test_simulated_sites_get_a_gpu_share_only_when_gpus_exist() -> None:
    from fedpose.cli.common import UserError
    from fedpose.cli.simulate import gpus_per_site

    def federation(sites: int, device: str = "auto", requested: float | None = None) -> SimpleNamespace:
        return SimpleNamespace(sites=[SimpleNamespace(train=SimpleNamespace(device=device))] * sites,
                               simulation=SimpleNamespace(gpus_per_site=requested))

    assert gpus_per_site(federation(3), 0) == 0.0
    assert gpus_per_site(federation(3), 1) == pytest.approx(0.3333) and 3 * gpus_per_site(federation(3), 1) <= 1
    assert gpus_per_site(federation(2), 4) == 1.0
    assert gpus_per_site(federation(3, device="cpu"), 2) == 0.0
    assert gpus_per_site(federation(3, requested=0.5), 1) == 0.5
    with pytest.raises(UserError, match="simulation.gpus_per_site = 0.5, but no CUDA GPU is visible"):
        gpus_per_site(federation(3, requested=0.5), 0)


# -- chunking and out-of-memory errors (CPU) ---------------------------------------------------------------
def test_chunk_size_is_fixed_on_cpu_and_sized_from_free_memory_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    assert auto_chunk_size(torch.device("cpu"), 4_740_000) == DEFAULT_CHUNK_SIZE == 16
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 12 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * gib)
    # half of (30 GiB free + 2 GiB cached) over 4 float32 copies of p = 4.74 M (19 MB each)
    expected = int(0.5 * 32 * gib // (4 * 4 * 4_740_000))
    assert auto_chunk_size(torch.device("cuda", 0), 4_740_000) == expected == 226
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    assert auto_chunk_size(torch.device("cuda", 0), 4_740_000) == 1  # never 0: the step then fails with the clear error


def test_a_measured_chunk_pays_for_what_a_sample_costs_beyond_its_gradient() -> None:
    gib = 2**30
    # the probe peaked at 1 GiB with 2 samples and 1.5 GiB with 4: 0.25 GiB a sample over a fixed 0.5 GiB;
    # half of 40 GiB, less 2 GiB of the step's own inputs and the fixed part, holds 70 samples
    assert chunk_size_from_probe(40 * gib, [gib, 3 * gib // 2], 1000, rows=1000, inputs_bytes=2 * gib) == 70
    assert chunk_size_from_probe(40 * gib, [gib, 3 * gib // 2], 1000, rows=16, inputs_bytes=2 * gib) == 16  # a step's rows
    assert chunk_size_from_probe(gib, [gib, 2 * gib], 1000, rows=16, inputs_bytes=0) == 1  # never 0
    # peaks that barely differ (allocator rounding) still cost a sample two float32 copies of p
    p = 4_740_000
    fixed = gib - 2 * 8 * p
    assert chunk_size_from_probe(40 * gib, [gib, gib], p, rows=1000, inputs_bytes=0) == int((20 * gib - fixed) // (8 * p)) == 540


def test_out_of_memory_names_the_settings_to_lower(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DeviceOutOfMemory, match=r"the thing ran out of device memory \(CUDA out of memory.*lower a.b or c.d"):
        with out_of_memory_hint("the thing", "a.b or c.d"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    def exhausted(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr("fedpose.privacy.engine.clipped_gradient_sum", exhausted)
    engine = build_engine(privacy("dpsgd"), model, 8, 4, 10, chunk_size=3)
    with pytest.raises(DeviceOutOfMemory) as failure:
        engine.step(model, batch_of(range(4)))
    message = str(failure.value)
    assert "a 'dpsgd' step on cpu (4 samples, per-sample gradients 3 at a time" in message
    assert message.endswith("lower train.batch_size, privacy.max_batch_units, privacy.max_records_per_unit, "
                            "privacy.augmentation_multiplicity or train.chunk_size")
    assert isinstance(failure.value, ValueError)  # the CLI reports it as `fedpose: error: …`


# -- the device keystream (CPU) ---------------------------------------------------------------------------
def test_chacha20_keystream_is_the_rfc_8439_cipher() -> None:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    key = bytes(range(7, 39))
    for first_block, blocks in ((0, 1), (3, 70)):
        ours = keystream_words(key, blocks, "cpu", first_block).numpy().astype("<u4").tobytes()
        nonce = first_block.to_bytes(4, "little") + bytes(12)  # 32-bit counter, then the 96-bit nonce (zero)
        reference = Cipher(algorithms.ChaCha20(key, nonce), None).encryptor().update(bytes(64 * blocks))
        assert ours == reference
    # the block counter carries into word 13 (a 64-bit counter) instead of wrapping
    words = keystream_words(key, 2, "cpu", (1 << 32) - 1).reshape(2, 16)
    assert not torch.equal(words[1], keystream_words(key, 1, "cpu", 0))


def test_device_noise_is_box_muller_on_the_chacha20_keystream() -> None:
    """chacha20_normal uses the keystream bytes exactly as SecureNoise uses AES's."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    key, size, std = bytes(range(32)), 1001, 2.5
    pairs = (size + 1) // 2
    raw = np.frombuffer(Cipher(algorithms.ChaCha20(key, bytes(16)), None).encryptor().update(bytes(12 * pairs)), np.uint8)
    low53 = raw[: 8 * pairs].view("<u8").astype(np.int64) & ((1 << 53) - 1)
    u = (low53 + 1).astype(np.float64) * 2.0**-53
    angle = raw[8 * pairs: 12 * pairs].view("<i4").astype(np.float64) * (2 * math.pi / 2**32)
    radius = std * np.sqrt(-2 * np.log(u))
    expected = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:size]
    ours = chacha20_normal(size, std, "cpu", key=key).double().numpy()
    assert np.allclose(ours, expected, rtol=1e-5, atol=1e-5 * std)


def test_device_noise_keys_are_fresh_per_draw() -> None:
    assert not torch.equal(chacha20_normal(64, 1.0, "cpu"), chacha20_normal(64, 1.0, "cpu"))


# -- every mechanism on the device under test (CPU always, CUDA where present) ---------------------------
class TensorPoseSet(torch.utils.data.Dataset):
    """Deterministic random samples with the keys every mechanism reads (as in test_dp_engine)."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.offset + i)
        h, w = SIZE
        image = torch.randn(3, h, w, generator=g)
        head = torch.tensor([[w * 0.3, h * 0.1, w * 0.6, h * 0.35]])
        return {
            "image": image,
            "public_image": torch.nn.functional.interpolate(torch.nn.functional.avg_pool2d(image[None], 8), size=SIZE)[0],
            "joints": torch.rand(16, 2, generator=g) * torch.tensor([w, h]),
            "weight": (torch.rand(16, generator=g) > 0.2).float(),
            "index": i,
            "head_boxes": head, "head_count": torch.tensor(1), "face_boxes": head, "face_count": torch.tensor(1),
            "private_reach": torch.tensor([1.5, 1.5]),
        }


PUBLIC = TensorPoseSet(6, offset=1000)


def make_model(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 'finetune without init_checkpoint'
        return build_model(ModelConfig(backbone="tiny_vit_test"), SIZE).to(device)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_model()


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """Small CPU ops on a shared, oversubscribed machine: one thread is ~100× faster than torch's default."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(autouse=True)
def float32_matmuls():
    """No TF32 during the comparisons (torch's cuDNN default allows it for convolutions)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def batch_of(ids, dataset: TensorPoseSet | None = None) -> dict:
    """The records ``ids``, with a public sample of other records (what engine.batches draws for the
    public-view mechanisms; the others ignore it)."""
    dataset = dataset or TensorPoseSet(8)
    batch = collate([dataset[i] for i in ids])
    batch["public_sample"] = collate([dataset[(i + 3) % len(dataset)] for i in ids])
    return batch


def privacy(mechanism: str, noise_multiplier: float = 0.05, clip: float = 1.0) -> PrivacyConfig:
    if mechanism == "none":
        return PrivacyConfig()
    return PrivacyConfig(mechanism=mechanism, noise_multiplier=noise_multiplier, max_grad_norm=clip, insecure_seeded_noise=True,
                         basis={"k": 3, "public_samples": 6, "refresh_every": 100})


def loop_gradients(model, features, joints, weight) -> list[torch.Tensor]:
    params = list(model.trainable_parameters().values())
    out = []
    for i in range(features.shape[0]):
        logits_x, logits_y = model.forward_trainable(features[i: i + 1])
        loss = model.loss(logits_x, logits_y, joints[i: i + 1], weight[i: i + 1]).sum()
        out.append(flatten(list(torch.autograd.grad(loss, params))))
    return out


def on(batch: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_per_sample_gradients_equal_a_loop(device: str) -> None:
    model = make_model(device)
    batch = on(batch_of(range(4)), device)
    features = frozen_features(model, batch["image"])
    grads, _ = per_sample_gradients(model, features, batch["joints"], batch["weight"])
    assert all(g.device.type == device and g.dtype == torch.float32 for g in grads.values())
    for i, reference in enumerate(loop_gradients(model, features, batch["joints"], batch["weight"])):
        ours = flatten([g[i] for g in grads.values()])
        assert (ours - reference).norm() / reference.norm() <= 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_the_clip_bound_holds(device: str) -> None:
    model = make_model(device)
    batch = on(batch_of(range(5)), device)
    features = frozen_features(model, batch["image"])
    grads, _ = per_sample_gradients(model, features, batch["joints"], batch["weight"])
    norms = per_sample_norms(grads)
    clip = float(norms.min()) * 0.5  # every sample is above the bound
    assert torch.all(norms * clip_factors(norms, clip) <= clip * (1 + 1e-5))
    total, _, _ = clipped_gradient_sum(model, features, batch["joints"], batch["weight"], clip, chunk_size=2)
    assert total.device.type == device
    expected = sum(g * min(1.0, clip / g.norm().item()) for g in loop_gradients(model, features, batch["joints"], batch["weight"]))
    assert (total - expected).norm() / expected.norm() <= 1e-4
    # sensitivity: dropping one sample moves the clipped sum by at most C
    without_last, _, _ = clipped_gradient_sum(model, features[:4], batch["joints"][:4], batch["weight"][:4], clip, chunk_size=2)
    assert float((total - without_last).norm()) <= clip * (1 + 1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_noise_std_is_sigma_c_on_the_device(device: str) -> None:
    std = 3.0
    sample = SecureNoise().normal(400_001, std, device=device)
    assert sample.device.type == device and sample.dtype == torch.float32
    z = sample.double().cpu().numpy() / std
    n = z.size
    assert abs(z.mean()) < 5 / math.sqrt(n)
    assert stats.chi2.ppf(5e-7, n) < float((z**2).sum()) < stats.chi2.ppf(1 - 5e-7, n)  # σ off by 1 %: 9 sd
    assert np.abs(z).max() <= SECURE_TAIL_BOUND_SIGMAS
    assert pvalue_of_two_draws(lambda: stats.kstest(
        SecureNoise().normal(400_001, std, device=device).double().cpu().numpy() / std, "norm").pvalue) > 1e-4

    # an empty batch releases noise only: gradient = N(0, σ²C²I) / B, on the model's device
    model = make_model(device)
    sigma, clip, batch_size = 2.0, 0.5, 4
    engine = build_engine(PrivacyConfig(mechanism="dpsgd", noise_multiplier=sigma, max_grad_norm=clip),
                          model, 8, batch_size, 10)
    engine.step(model, collate([], template=batch_of([0])))
    released = flatten([p.grad for p in model.trainable_parameters().values()])
    assert released.device.type == device
    expected_std = sigma * clip / batch_size
    assert float(released.std()) == pytest.approx(expected_std, rel=5 / math.sqrt(released.numel()) + 0.01)


@pytest.mark.parametrize("mechanism", MECHANISMS)
@requires_cuda
def test_a_cpu_and_a_cuda_step_agree(mechanism: str) -> None:
    """Same weights, batch and (seeded) noise: the released gradient agrees to float32 tolerance."""
    batch = batch_of(range(4))
    released, reference_basis = {}, None
    for device in ("cpu", "cuda"):
        model = make_model(device)
        engine = build_engine(privacy(mechanism), model, 8, 4, 10, PUBLIC, seed=3)
        if engine.mechanism.projects:
            if reference_basis is None:
                engine.refresh_basis(model)
                reference_basis = engine.basis.vectors.clone()
            else:
                engine.set_basis(reference_basis.clone())  # the same V: this test is about the step
        engine.step(model, batch)
        released[device] = flatten([p.grad for p in model.trainable_parameters().values()]).cpu()
    difference = (released["cuda"] - released["cpu"]).norm() / released["cpu"].norm()
    assert difference <= 1e-4, f"{mechanism}: relative difference {float(difference):.2e}"


@pytest.mark.parametrize("device", DEVICES)
def test_basis_refresh_and_projection_run_on_the_device(device: str) -> None:
    model = make_model(device)
    engine = build_engine(privacy("pdp"), model, 8, 4, 10, PUBLIC, seed=3)
    engine.refresh_basis(model)
    basis = engine.basis
    assert basis.vectors.device.type == device and basis.vectors.dtype == torch.float32
    # VᵀV in float64, against the bound orthonormalize enforces (measured in float64 too): a float32
    # product of p ≈ 10⁶ terms adds its own round-off (4e-5 on an AMD EPYC)
    gram = (basis.vectors.double().T @ basis.vectors.double()).cpu()
    assert torch.allclose(gram, torch.eye(basis.k, dtype=torch.float64), atol=ORTHONORMAL_TOLERANCE)
    g = torch.randn(basis.vectors.shape[0], device=device)
    projected = basis.project(g)
    assert projected.device.type == device
    assert torch.allclose(basis.project(projected), projected, atol=1e-5)  # V Vᵀ is a projection
    # the device's public gradients equal the CPU's, and V lies in their span (no eigen-gap sensitivity)
    public = collate([PUBLIC[i] for i in basis.public_ids])
    cpu_model = make_model("cpu")
    reference = per_sample.gradient_matrix(cpu_model, frozen_features(cpu_model, public["image"]), public["joints"], public["weight"])
    ours = per_sample.gradient_matrix(model, frozen_features(model, public["image"].to(device)), public["joints"].to(device),
                                      public["weight"].to(device))
    assert ((ours.cpu() - reference).norm(dim=1) / reference.norm(dim=1)).max() <= 1e-4
    span, _ = torch.linalg.qr(reference.double().T)  # p × m, orthonormal columns spanning the public gradients
    v = basis.vectors.double().cpu()
    assert float((v - span @ (span.T @ v)).norm()) <= 1e-4 * math.sqrt(basis.k)


@pytest.mark.parametrize("device", DEVICES)
def test_batch_norm_stays_frozen_on_the_device(device: str) -> None:
    model = make_model(device)
    batch_norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert batch_norms
    before = [(m.running_mean.clone(), m.running_var.clone()) for m in batch_norms]
    for mechanism in MECHANISMS:
        engine = build_engine(privacy(mechanism), model, 8, 4, 10, PUBLIC, seed=3)
        engine.step(model, batch_of(range(4)))
    assert all(not m.training for m in batch_norms)
    for m, (mean, var) in zip(batch_norms, before):
        assert torch.equal(m.running_mean, mean) and torch.equal(m.running_var, var)


@requires_cuda
def test_per_sample_chunks_are_sized_from_cuda_memory() -> None:
    chunk = auto_chunk_size(torch.device("cuda", 0), 4_740_000)
    free, _ = torch.cuda.mem_get_info(0)
    assert 1 <= chunk <= per_sample._MAX_AUTO_CHUNK and chunk * 4 * 4 * 4_740_000 <= free + torch.cuda.memory_reserved(0)


@requires_cuda
def test_a_chunk_measured_on_the_model_fits_what_it_was_sized_for() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone="tiny_vit_test", scenario="biases_norms"), (128, 96)).cuda()
    device = torch.device("cuda", 0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    chunk = measured_chunk_size(model, device, rows=4096)
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # the probe changed nothing
    available = per_sample.available_device_memory(device)
    samples = min(chunk, 256)  # enough to check the slope, not the whole device
    used, _ = per_sample.chunk_peak_bytes(model, device, samples)
    assert 1 <= chunk <= per_sample._MAX_AUTO_CHUNK
    assert used / samples * chunk <= per_sample._DEVICE_MEMORY_SHARE * available * 1.1  # a full chunk fits its share
    num_params = sum(p.numel() for p in model.trainable_parameters().values())
    assert used / samples > 2 * 4 * num_params  # the activations, which the gradients-only sizing leaves out


@requires_cuda
def test_a_cuda_engine_measures_its_chunk_when_it_is_built() -> None:
    model = make_model("cuda")
    engine = build_engine(privacy("fpdp"), model, 8, 4, 10, PUBLIC, seed=3)
    num_params = sum(p.numel() for p in model.trainable_parameters().values())
    chunk = engine.chunk_for(torch.device("cuda", 0), num_params)
    assert engine._chunks[("cuda:0", num_params)] == chunk and 1 <= chunk <= engine.step_rows
    engine.step(model, batch_of(range(4)))
    assert engine.chunk_for(torch.device("cuda", 0), num_params) == chunk  # decided once, never per step
    fixed = build_engine(privacy("fpdp"), model, 8, 4, 10, PUBLIC, seed=3, chunk_size=3)
    assert fixed.chunk_for(torch.device("cuda", 0), num_params) == 3 and not fixed._chunks


# -- the entry points on CUDA --------------------------------------------------------------------------------
@requires_cuda
def test_central_training_and_a_site_round_run_on_cuda_and_say_so(tmp_path: Path) -> None:
    from fedpose.data.synthetic import generate_dataset
    from fedpose.federation.local_training import ROUND_LOG, run_site_round
    from fedpose.model import load_checkpoint
    from fedpose.train.central import run_training
    from site_round_helpers import global_model, make_site_data, site_config

    data = tmp_path / "data"
    generate_dataset(data, sites=1, per_site=6, public=8, test=4, size=SIZE, workers=1, progress=False)
    cfg = load_config(None, [
        f'data.train="{data / "site-1"}"', f'data.val="{data / "test"}"', f"data.input_size={list(SIZE)}",
        'model.backbone="tiny_vit_test"', 'model.scenario="scratch"', f'privacy.basis.public_data="{data / "public"}"',
        'privacy.mechanism="fpdp"', "privacy.noise_multiplier=1.0", "privacy.basis.k=3", "privacy.basis.public_samples=4",
        "privacy.public_view.factor=8", "train.steps=2", "train.batch_size=2", "train.eval_every=2", 'train.device="cuda"',
        f'train.out_dir="{tmp_path / "run"}"',
    ])
    summary = run_training(cfg, progress=False, log=lambda _: None)
    assert summary["device"].startswith("cuda:0 (")
    assert json.loads((tmp_path / "run" / "privacy.json").read_text())["device"] == summary["device"]
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["model"]  # readable on the host

    site_data = make_site_data(tmp_path / "site-data")
    site = site_config(site_data, tmp_path / "state").model_copy(update={"train": site_config(
        site_data, tmp_path / "state").train.model_copy(update={"device": "cuda"})})
    global_state, spec = global_model()
    result = run_site_round(site, "run", 1, global_state, spec, 2)
    assert result.reply.status == "ok" and all(np.isfinite(v).all() for v in result.update.values())
    assert json.loads((tmp_path / "state" / ROUND_LOG).read_text().splitlines()[-1])["device"].startswith("cuda:0")
