"""Configs are validated data: every shipped recipe loads, and bad recipes/overrides fail with the key's name."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from drafttrain.config import RECIPES_DIR, Config, ConfigError, load_recipe, save_config

RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))


def write(tmp_path, text: str, name: str = "r.yaml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


MINIMAL = "engine:\n  k: 3\ndrafter:\n  path: null\n"


# ---- shipped recipes ---------------------------------------------------------------------------------------------

def test_recipes_exist():
    names = {p.stem for p in RECIPES}
    assert RECIPES, f"no recipes in {RECIPES_DIR}"
    assert {"eagle3_track", "eagle3_frozen"} <= names, names


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_loads(path):
    by_name = load_recipe(path.stem)
    by_path = load_recipe(str(path))
    assert OmegaConf.to_container(by_name) == OmegaConf.to_container(by_path)
    assert by_name.recipe == path.stem
    assert "${" not in OmegaConf.to_yaml(by_name)  # fully resolved
    # every key the file sets survives into the config (nothing silently dropped)
    data = OmegaConf.to_container(OmegaConf.load(path))
    cfg = OmegaConf.to_container(by_name)
    for section, values in data.items():
        if isinstance(values, dict):
            for k, v in values.items():
                assert cfg[section][k] == v, f"{section}.{k}"
    # overrides apply on top
    assert load_recipe(path.stem, ["engine.k=2"]).engine.k == 2
    # the first lines say what it does and how to launch it
    head = path.read_text().splitlines()
    assert head[0].startswith("#"), "a recipe starts with a comment saying what it does"
    comments = [line for line in head[:10] if line.startswith("#")]
    assert any("launch" in line.lower() for line in comments), "the leading comment says how to launch it"


# ---- overrides and errors ------------------------------------------------------------------------------------------

def test_overrides_and_defaults(tmp_path):
    path = write(tmp_path, MINIMAL, "mine.yaml")
    cfg = load_recipe(path, ["engine.drafter_int8=false", "sampling.top_p=0.9", "drafter.aux_layer_ids=[0,2]"])
    assert cfg.recipe == "mine" and cfg.run.out_dir == "runs/mine"
    assert cfg.engine.k == 3 and cfg.engine.drafter_int8 is False and cfg.sampling.top_p == 0.9
    assert list(cfg.drafter.aux_layer_ids) == [0, 2] and cfg.drafter.path is None
    assert cfg.engine.max_len == Config().engine.max_len  # untouched defaults
    renamed = load_recipe(path, ["recipe=other"])
    assert renamed.recipe == "other" and renamed.run.out_dir == "runs/other"


@pytest.mark.parametrize("override,key", [
    ("drafter.nope=1", "drafter.nope"),
    ("nosection.x=1", "nosection"),
    ("engine.k=abc", "engine.k"),
    ("engine.drafter_int8=maybe", "engine.drafter_int8"),
    ("sampling.temperature=hot", "sampling.temperature"),
    ("engine.k=0", "engine.k"),
    ("sampling.top_p=0", "sampling.top_p"),
    ("engine.kind=tpu", "engine.kind"),
    ("drafter.ttt_steps=0", "drafter.ttt_steps"),
    # ranges that were accepted and failed later under another name, or silently (a -inf TTT loss, one query)
    ("engine.k=true", "engine.k"),
    ("engine.max_len=-5", "engine.max_len"),
    ("sampling.temperature=nan", "sampling.temperature"),
    ("sampling.top_k=-1", "sampling.top_k"),
    ("sampling.max_new_tokens=0", "sampling.max_new_tokens"),
    ("drafter.ttt_decay=-1", "drafter.ttt_decay"),
    ("train.lr=0", "train.lr"),
    ("train.batch_size=0", "train.batch_size"),
    ("train.query_frac=0", "train.query_frac"),
    ("train.query_frac=2", "train.query_frac"),
    ("online.steps_per_update=0", "online.steps_per_update"),
    ("online.time_budget_s=0", "online.time_budget_s"),
    ("online.canary_prompts=0", "online.canary_prompts"),
    ("online.canary_max_new_tokens=0", "online.canary_max_new_tokens"),
    ("rl.steps=-1", "rl.steps"),
    ("rl.prompts_per_step=0", "rl.prompts_per_step"),
    ("rl.micro_batch=0", "rl.micro_batch"),
    ("rl.lr=-1e-4", "rl.lr"),
])
def test_bad_override_names_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError) as e:
        load_recipe(write(tmp_path, MINIMAL), [override])
    assert key in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override", ["online.gate_confidence=0.3", "online.gate_confidence=1",
                                      "online.gate_margin=-0.1", "online.gate_margin=nan", "online.gate_min_rows=1"])
def test_publish_gate_keys_are_checked(tmp_path, override):
    """The gate's confidence is a one-sided level (a bound below 0.5 would publish most equal drafters), its margin a
    MAL gain, and its bound needs a spread: two rows at least."""
    with pytest.raises(ConfigError, match=override.split("=")[0]) as e:
        load_recipe(write(tmp_path, MINIMAL), [override])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text,key", [
    ("engine:\n  kk: 1\n", "engine.kk"),
    ("engine:\n  k: four\n", "engine.k"),
    ("bogus:\n  a: 1\n", "bogus"),
])
def test_bad_recipe_file_names_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_recipe(write(tmp_path, text))


def test_override_without_equals(tmp_path):
    with pytest.raises(ConfigError, match="engine.k"):
        load_recipe(write(tmp_path, MINIMAL), ["engine.k"])


@pytest.mark.parametrize("text", ["engine: [1, 2\n", "engine:\n  k: 1\n k2: {\n", "\tengine: 1\n"])
def test_malformed_yaml(tmp_path, text):
    with pytest.raises(ConfigError, match="YAML"):
        load_recipe(write(tmp_path, text))


@pytest.mark.parametrize("text", ["- engine\n- drafter\n", "just a string\n", "42\n"])
def test_non_mapping_yaml(tmp_path, text):
    with pytest.raises(ConfigError):
        load_recipe(write(tmp_path, text))


def test_unknown_recipe_name():
    with pytest.raises(ConfigError, match="no recipe file"):
        load_recipe("no_such_recipe_xyz")


# ---- resolved config beside the outputs --------------------------------------------------------------------------

def test_save_config_writes_resolved_yaml(tmp_path):
    cfg = load_recipe(write(tmp_path, MINIMAL, "saved.yaml"), ["engine.k=5", "run.seed=7"])
    out = save_config(cfg, tmp_path / "run" / "a")
    assert out == tmp_path / "run" / "a" / "config.yaml" and out.is_file()
    text = out.read_text()
    assert "${" not in text and "out_dir: runs/saved" in text
    back = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(out))  # validates against the schema
    assert OmegaConf.to_container(back) == OmegaConf.to_container(cfg)
    assert back.engine.k == 5 and back.run.seed == 7
    # and it loads again as a recipe, to the same config
    again = load_recipe(str(out))
    assert OmegaConf.to_container(again) == OmegaConf.to_container(cfg)
