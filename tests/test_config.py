"""RunConfig validation: unknown keys and invalid values are rejected with the dotted key named."""

from __future__ import annotations

from pathlib import Path

import re

import pytest

from fedpose.config import ConfigError, RunConfig, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text,key", [
    ("[model]\nbackbon = 'tiny_vit_test'\n", "model.backbon: unknown key"),
    ("[trainer]\nsteps = 3\n", "trainer: unknown key"),
    ("[privacy.basis]\nkk = 3\n", "privacy.basis.kk: unknown key"),
    ("[model]\nscenario = 'partial'\n", "model.scenario"),
    ("[model]\nsplit_factor = 0\n", "model.split_factor"),
    ("[model]\nlabel_sigma = -1.0\n", "model.label_sigma"),
    ("[model]\nhead_hidden = -5\n", "model.head_hidden"),
    ("[train]\nsteps = 'many'\n", "train.steps"),
    ("[optim]\nlr = 0\n", "optim.lr"),
    ("[data]\ninput_size = [100, 96]\n", "data.input_size"),
    ("[privacy]\nmechanism = 'dpsgd'\n", "privacy.target_epsilon or privacy.noise_multiplier"),
])
def test_invalid_config_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert key in str(info.value)


def test_override_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="train.batch_size"):
        load_config(None, ["train.batch_size=0"])
    with pytest.raises(ConfigError, match="model.colour: unknown key"):
        load_config(None, ["model.colour=1"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["train.steps"])


def test_overrides_apply_on_top_of_the_file(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "[train]\nsteps = 3\n"), ["train.steps=7", 'model.backbone="tiny_vit_test"'])
    assert cfg.train.steps == 7 and cfg.model.backbone == "tiny_vit_test"


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[model\n"))


@pytest.mark.parametrize("name", ["central.toml", "pretrain.toml", "finetune-site.toml"])
def test_shipped_training_configs_are_valid(name: str) -> None:
    cfg = load_config(CONFIGS / name)
    assert isinstance(cfg, RunConfig) and cfg.data.train is not None


@pytest.mark.parametrize(("section", "key"), [
    ("model", "model"),  # the coordinator's instruction carries the model spec
    ("data", "data.input_size"),  # the site trains at the global model's input size
    ("data", "data.val"),  # the coordinator evaluates
    ("train", "train.steps"),  # the coordinator asks for the round's local steps
])
def test_a_site_config_rejects_keys_the_site_does_not_use(section: str, key: str) -> None:
    from fedpose.config import validate
    from fedpose.federation.config import SiteConfig

    raw = {"site_id": "site-1", "data": {"train": "data/site-1"}, "state_dir": "state", "eps_max": 8.0,
           "privacy": {"mechanism": "none"}}
    leaf = key.split(".")[-1]
    raw[section] = {**raw.get(section, {}), leaf: 1} if section != key else {"backbone": "tiny_vit_test"}
    with pytest.raises(ConfigError, match=f"{key}: unknown key"):
        validate(SiteConfig, raw, "site.toml")


def test_set_reaches_per_site_keys_by_index_or_site_id(tmp_path: Path) -> None:
    """`fedpose simulate --set sites.1.eps_max=4`: every key a federation file can hold is reachable."""
    from fedpose.cli.simulate import resolve_federation

    config = Path(__file__).resolve().parents[1] / "configs" / "demo.toml"
    checkpoint = f'coordinator.checkpoint_dir="{tmp_path / "coordinator"}"'
    federation, _, _ = resolve_federation(config, [checkpoint, "sites.1.eps_max=4", "sites.site-3.privacy.delta=1e-6",
                                                   "sites.0.train.batch_size=4"])
    by_id = {site.site_id: site for site in federation.sites}
    assert by_id["site-2"].eps_max == 4 and by_id["site-1"].eps_max != 4
    assert by_id["site-3"].privacy.delta == 1e-6 and by_id["site-1"].train.batch_size == 4
    for bad, message in (("sites.3.eps_max=4", "index 3 out of range (3 entries, counted from 0)"),
                         ("sites.site-9.eps_max=4", "no entry with site_id 'site-9'"),
                         ("sites.eps_max=4", "'sites' is a list of tables"),
                         ("sites.0.colour=1", "sites.0.colour: unknown key")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            resolve_federation(config, [checkpoint, bad])
