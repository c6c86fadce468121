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
    def leaves(d, pre=""):
        for k, v in d.items():
            yield from leaves(v, f"{pre}{k}.") if isinstance(v, dict) else [(f"{pre}{k}", v)]

    cfg = OmegaConf.to_container(by_name)
    for key, v in leaves(OmegaConf.to_container(OmegaConf.load(path))):
        assert OmegaConf.select(OmegaConf.create(cfg), key) == v, key
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
    cfg = load_recipe(path, ["engine.drafter_int8=false", "sampling.top_p=0.9", "drafter.eagle3.aux_layer_ids=[0,2]"])
    assert cfg.recipe == "mine" and cfg.run.out_dir == "runs/mine"
    assert cfg.engine.k == 3 and cfg.engine.drafter_int8 is False and cfg.sampling.top_p == 0.9
    assert list(cfg.drafter.eagle3.aux_layer_ids) == [0, 2] and cfg.drafter.path is None
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
    ("train.loss=ce", "train.loss"),
    ("train.tv_weight=-0.5", "train.tv_weight"),
    ("train.tv_weight=nan", "train.tv_weight"),
    ("train.positions=worst", "train.positions"),
    ("online.steps_per_update=0", "online.steps_per_update"),
    ("online.time_budget_s=0", "online.time_budget_s"),
    ("online.canary_prompts=0", "online.canary_prompts"),
    ("online.canary_max_new_tokens=0", "online.canary_max_new_tokens"),
    ("rl.steps=-1", "rl.steps"),
    ("rl.prompts_per_step=0", "rl.prompts_per_step"),
    ("rl.micro_batch=0", "rl.micro_batch"),
    ("rl.micro_tokens=0", "rl.micro_tokens"),
    ("rl.lr=-1e-4", "rl.lr"),
    # accepted, and training went wrong: a negative norm flipped the drafter's gradients, a negative clip the PPO's
    ("train.max_grad_norm=-1", "train.max_grad_norm"),
    ("train.max_grad_norm=0", "train.max_grad_norm"),
    ("train.max_grad_norm=nan", "train.max_grad_norm"),
    ("rl.clip_eps=-0.2", "rl.clip_eps"),
    ("rl.clip_eps=0", "rl.clip_eps"),
    ("train.weight_decay=-1", "train.weight_decay"),
    ("drafter.eagle3.draft_vocab_size=0", "drafter.eagle3.draft_vocab_size"),
    ("drafter.eagle3.intermediate_size=-3", "drafter.eagle3.intermediate_size"),
    ("online.canary_min_ratio=-1", "online.canary_min_ratio"),
    # an empty value read as null (drafter.path: a fresh random drafter) or as the project root / working directory
    ("drafter.path=", "drafter.path"),
    ("online.buffer_half_life=", "online.buffer_half_life"),
    ("drafter.eagle3.aux_layer_ids= ", "drafter.eagle3.aux_layer_ids"),
    ("drafter.path=''", "drafter.path"),
    ("policy.path=' '", "policy.path"),
    ("run.out_dir=''", "run.out_dir"),
    ("run.checkpoint_every=0", "run.checkpoint_every"),
    ("run.checkpoint_every=often", "run.checkpoint_every"),
    ("run.keep_checkpoints=0", "run.keep_checkpoints"),
    ("run.keep_checkpoints=-2", "run.keep_checkpoints"),
])
def test_bad_override_names_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError) as e:
        load_recipe(write(tmp_path, MINIMAL), [override])
    assert key in str(e.value)
    assert "\n" not in str(e.value)


def test_empty_drafter_path_says_null_is_the_fresh_drafter(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_recipe("eagle3_track", ["drafter.path="])
    assert "drafter.path=null" in str(e.value) and "fresh" in str(e.value), e.value
    assert load_recipe("eagle3_track", ["drafter.path=null"]).drafter.path is None  # still the way to ask for one


def test_max_grad_norm_inf_means_no_clipping():
    assert load_recipe("eagle3_track", ["train.max_grad_norm=inf"]).train.max_grad_norm == float("inf")


@pytest.mark.parametrize("override", ["online.gate_confidence=0.3", "online.gate_confidence=1",
                                      "online.gate_margin=-0.1", "online.gate_margin=nan", "online.gate_min_rows=1"])
def test_publish_gate_keys_are_checked(tmp_path, override):
    """The gate's confidence is a one-sided level (a bound below 0.5 would publish most equal drafters), its margin a
    MAL gain, and its bound needs a spread: two rows at least."""
    with pytest.raises(ConfigError, match=override.split("=")[0]) as e:
        load_recipe(write(tmp_path, MINIMAL), [override])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override", ["online.capture_frac=0", "online.capture_frac=1.5", "online.capture_frac=-1"])
def test_capture_frac_is_a_share(tmp_path, override):
    with pytest.raises(ConfigError, match="online.capture_frac: must be in") as e:
        load_recipe(write(tmp_path, MINIMAL), [override])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override,match", [
    ("engine.vllm.gpu_memory_utilization=0", "engine.vllm.gpu_memory_utilization: must be in (0, 1]"),
    ("engine.vllm.gpu_memory_utilization=1.2", "engine.vllm.gpu_memory_utilization: must be in (0, 1]"),
    ("engine.vllm.gpu_memory_utilization=-0.5", "engine.vllm.gpu_memory_utilization: must be in (0, 1]"),
    ("engine.vllm.gpu_memory_utilization=lots", "engine.vllm.gpu_memory_utilization"),
    ("engine.vllm.dtype=fp8", "engine.vllm.dtype: must be one of auto, bfloat16, float16, float32"),
    ("engine.vllm.enforce_eager=maybe", "engine.vllm.enforce_eager"),
    ("engine.vllm.sleep=2", "engine.vllm.sleep: must be 0"),
    ("engine.vllm.sleep=-1", "engine.vllm.sleep: must be 0"),
    ("engine.vllm.nope=1", "engine.vllm.nope"),
])
def test_vllm_keys_are_checked(tmp_path, override, match):
    """engine.vllm.*: a bad value fails at load time in one line naming the key (a GPU share of 0 or above 1 would
    reach vLLM, and a level-2 sleep silently drops the drafter's weights)."""
    with pytest.raises(ConfigError) as e:
        load_recipe(write(tmp_path, MINIMAL), [override])
    assert match in str(e.value) and "\n" not in str(e.value), e.value


def test_vllm_keys_load_and_engine_checks_them_too(tmp_path):
    from drafttrain.vllm_config import VllmConfig, check_vllm

    cfg = load_recipe(write(tmp_path, MINIMAL))
    assert cfg.engine.vllm.dtype == "auto" and cfg.engine.vllm.enforce_eager is None
    assert cfg.engine.vllm.gpu_memory_utilization == 0.5 and cfg.engine.vllm.sleep == 0
    cfg = load_recipe(write(tmp_path, MINIMAL), ["engine.vllm.dtype=bfloat16", "engine.vllm.enforce_eager=true",
                                                 "engine.vllm.gpu_memory_utilization=1", "engine.vllm.sleep=1"])
    assert (cfg.engine.vllm.dtype, cfg.engine.vllm.enforce_eager, cfg.engine.vllm.sleep) == ("bfloat16", True, 1)
    # the engine is also built from sections that never passed load_recipe: it checks them itself
    check_vllm(VllmConfig())
    with pytest.raises(ValueError, match=r"^engine.vllm.gpu_memory_utilization: must be in \(0, 1\], got 0$"):
        check_vllm(VllmConfig(gpu_memory_utilization=0))


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


# ---- run.out_dir and --help --------------------------------------------------------------------------------------

def test_out_dir_must_be_a_folder_or_makeable(tmp_path):
    from drafttrain.rl.runfolder import check_out_dir

    f = tmp_path / "file.md"
    f.write_text("x")
    for bad in (f, f / "run"):
        with pytest.raises(ConfigError, match="run.out_dir") as e:
            check_out_dir(bad)
        assert "\n" not in str(e.value) and str(f) in str(e.value)
    check_out_dir(tmp_path)  # an existing folder
    check_out_dir(tmp_path / "a" / "b")  # one that can be made
    assert not (tmp_path / "a").exists()  # the check makes nothing


def test_every_key_has_its_default_and_a_doc():
    from drafttrain.config import key_docs

    docs = key_docs()
    flat = {}

    def walk(node, prefix=""):
        for k, v in node.items():
            (walk(v, f"{prefix}{k}.") if isinstance(v, dict) else flat.__setitem__(prefix + k, v))

    walk(OmegaConf.to_container(OmegaConf.structured(Config)))
    assert set(docs) == set(flat)
    for key, (default, doc) in docs.items():
        assert default == flat[key], key
        assert doc and "\n" not in doc, f"{key}: give its dataclass field a trailing `# one-line doc`"
    assert docs["engine.max_len"][1].startswith("positions per row")  # the trailing comment, not a neighbour's
    assert docs["train.query_frac"][1].startswith("share of positions")  # not the comment block above it


def test_usage_lists_launch_recipes_and_every_key():
    from drafttrain.config import key_docs
    from drafttrain.online import usage

    text = usage()
    assert "accelerate launch" in text and "python -m drafttrain.online" in text and "resumes" in text
    for p in RECIPES:
        first = p.read_text().splitlines()[0].lstrip("# ").removeprefix(f"{p.stem}:").strip()
        assert any(line.split()[:1] == [p.stem] and first in line for line in text.splitlines()), p.stem
    lines = text.splitlines()
    for key, (_, doc) in key_docs().items():
        if key == "recipe":  # the usage lines say recipe=NAME, default eagle3_track (the field's "custom" is for files)
            assert "default eagle3_track" in text
            continue
        assert any(line.strip().startswith(f"{key}=") and line.rstrip().endswith(doc) for line in lines), key
    # as overrides write them
    assert "  engine.ladder=[2,3,4,6,8]" in text and "  drafter.eagle3.aux_layer_ids=null" in text


# ---- relative paths: the working directory, the shipped assets from anywhere ---------------------------------
def test_a_relative_path_resolves_against_the_working_directory(tmp_path, monkeypatch):
    from drafttrain.config import resolve_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.jsonl").write_text("{}\n")
    assert resolve_path("prompts.jsonl") == tmp_path / "prompts.jsonl"
    assert resolve_path("missing.jsonl") == tmp_path / "missing.jsonl"  # the error then names where it looked


def test_the_shipped_assets_resolve_to_the_installed_copy_from_any_folder(tmp_path, monkeypatch):
    from drafttrain.config import PROJECT_ROOT, resolve_path

    monkeypatch.chdir(tmp_path)
    assert resolve_path(Config().policy.path) == PROJECT_ROOT / "checkpoints/policy"
    assert resolve_path("checkpoints/eagle3") == PROJECT_ROOT / "checkpoints/eagle3"
    assert load_recipe("recipes/eagle3_track.yaml").recipe == "eagle3_track"
    (tmp_path / "checkpoints/policy").mkdir(parents=True)  # the user's own copy, where they stand, wins
    assert resolve_path("checkpoints/policy") == tmp_path / "checkpoints/policy"
