"""Round trips with the real speculators library (installed by scripts/install.sh): a drafttrain EAGLE-3 export
loads in speculators with nothing missing or unexpected and computes the same logits; a checkpoint saved by
speculators loads here with equal weights and drafts as its source does."""
from __future__ import annotations

import json

import pytest
import torch
import transformers.modeling_utils
from safetensors.torch import load_file
from drafttrain.config import PROJECT_ROOT
from drafttrain.drafters import eagle3
from drafttrain.engines import build_engine
from drafttrain.export import load_drafter, save_drafter
from drafttrain.policy import encode_prompt, make_prompts
from drafttrain.policy.model import load_policy
from drafttrain.spec import SamplingParams
from tests.conftest import engine_cfg
from tests.unit.test_drafter import perturbed

T, STEPS = 128, 3  # speculators' default flex attention builds its masks in blocks of 128 positions
pytestmark = [pytest.mark.slow,  # importing speculators takes 10-30 s here
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]


@pytest.fixture(scope="module")
def Eagle3DraftModel():
    """speculators' EAGLE-3 model class, imported by the tests that use it (not at collection)."""
    from speculators.models.eagle3 import Eagle3DraftModel

    return Eagle3DraftModel


@pytest.fixture(scope="module")
def verifier(tmp_path_factory, policy):
    """The tiny policy as a folder: speculators reads the verifier's depth and weights from its path."""
    path = tmp_path_factory.mktemp("verifier")
    policy.save_pretrained(str(path))
    return path


@pytest.fixture
def load_reports(monkeypatch):
    """The load report transformers builds in from_pretrained (missing / unexpected / mismatched tensors)."""
    seen = []
    report = transformers.modeling_utils.log_state_dict_report

    def record(model, pretrained_model_name_or_path, ignore_mismatched_sizes, loading_info, logger=None):
        seen.append(loading_info)
        return report(model, pretrained_model_name_or_path, ignore_mismatched_sizes, loading_info, logger)

    monkeypatch.setattr(transformers.modeling_utils, "log_state_dict_report", record)
    return seen


def drafter_for(policy, draft_vocab: int | None, seed: int) -> eagle3.Eagle3Drafter:
    d = eagle3.Eagle3Drafter(eagle3.config_from_policy(policy.config, draft_vocab_size=draft_vocab))
    if draft_vocab:
        d.set_vocab_map(torch.randperm(policy.config.vocab_size, generator=torch.Generator().manual_seed(seed))
                        [:draft_vocab])
    return perturbed(d, seed=seed)


@torch.no_grad()
def both_logits(m, d: eagle3.Eagle3Drafter, seed: int):
    """Draft logits of each training-time-test step from speculators' forward and from drafttrain's, on the same
    policy hidden states and tokens: lists of [T - i, Vd] (step i's last i positions see padding in speculators)."""
    c = d.config
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, T, len(c.aux_layer_ids) * c.hidden_size, generator=g)
    next_ids = torch.randint(0, c.vocab_size, (1, T + STEPS - 1), generator=g)
    theirs = []
    hook = m.lm_head.register_forward_hook(lambda mod, args, out: theirs.append(out))
    try:
        m(hidden_states=aux, input_ids=next_ids[:, :T], document_ids=torch.zeros(1, T, dtype=torch.long),
          position_ids=torch.arange(T)[None], ttt_steps=STEPS)
    finally:
        hook.remove()
    ours = d.ttt_logits(aux, next_ids, STEPS)
    return [t[0, :T - i] for i, t in enumerate(theirs)], [o[0, :T - i] for i, o in enumerate(ours)]


@pytest.mark.parametrize("draft_vocab", [None, 20])
def test_drafttrain_export_loads_in_speculators(Eagle3DraftModel, tmp_path, policy, verifier, load_reports,
                                                draft_vocab):
    d = drafter_for(policy, draft_vocab, seed=1).eval()
    out = save_drafter(d, tmp_path / "eagle3", verifier=verifier, k=STEPS)
    m = Eagle3DraftModel.from_pretrained(str(out)).eval()

    (info,) = load_reports
    assert not info.missing_keys and not info.unexpected_keys and not info.mismatched_keys, info
    written, loaded = load_file(str(out / "model.safetensors")), m.state_dict()
    from_verifier = {"verifier_lm_head.weight", "verifier_norm.weight"}  # speculators' own copies, never saved
    assert set(written) == set(loaded) - from_verifier
    for name, t in written.items():
        assert torch.equal(loaded[name], t), name
    cfg = m.config
    assert cfg.eagle_aux_hidden_state_layer_ids == list(d.aux_layer_ids)
    assert cfg.draft_vocab_size == d.config.draft_vocab_size and cfg.norm_before_residual is False
    assert cfg.transformer_layer_config.num_hidden_layers == 1
    assert cfg.speculators_config.verifier.name_or_path == str(verifier)

    theirs, ours = both_logits(m, d, seed=2)
    for i, (a, b) in enumerate(zip(theirs, ours)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda s: f"TTT step {i}: {s}")


@pytest.mark.parametrize("draft_vocab", [None, 20])
def test_speculators_checkpoint_loads_here(Eagle3DraftModel, tmp_path, policy, verifier, draft_vocab):
    """A drafter made and saved by speculators itself (its training entry point's constructor, random weights)."""
    pc, V = policy.config, policy.config.vocab_size
    layer = transformers.LlamaConfig(
        vocab_size=V, hidden_size=pc.hidden_size, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=pc.num_attention_heads, num_key_value_heads=pc.num_key_value_heads,
        head_dim=pc.hidden_size // pc.num_attention_heads, max_position_embeddings=pc.max_position_embeddings,
        rms_norm_eps=pc.rms_norm_eps, tie_word_embeddings=False)
    t2d = d2t = None
    if draft_vocab:
        ids = torch.randperm(V, generator=torch.Generator().manual_seed(3))[:draft_vocab].sort().values
        t2d, d2t = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True), ids - torch.arange(draft_vocab)
    m = Eagle3DraftModel.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab or V, norm_before_residual=False,
        ttt_steps=STEPS, verifier_name_or_path=str(verifier), target_layer_ids=[0, 2, 3])
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    m.eval().save_pretrained(str(tmp_path / "spec"))
    assert "layers.0.hidden_norm.weight" in load_file(str(tmp_path / "spec" / "model.safetensors"))

    d = load_drafter(tmp_path / "spec", target_num_layers=pc.num_hidden_layers).eval()
    assert d.aux_layer_ids == (0, 2, 3) and d.config.intermediate_size == 96
    theirs_w = m.state_dict()  # a full draft vocabulary has no d2t/t2d in speculators: the identity map here
    assert set(d.state_dict()) - set(theirs_w) == (set() if draft_vocab else {"d2t", "t2d"})
    for name, t in theirs_w.items():
        if not name.startswith("verifier_"):  # speculators' copies of the verifier's head, never saved
            assert torch.equal(t, d.state_dict()[name]), name
    theirs, ours = both_logits(m, d, seed=5)
    for i, (a, b) in enumerate(zip(theirs, ours)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda s: f"TTT step {i}: {s}")
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"TTT step {i}: other drafts"


def test_speculators_resave_serves_with_the_sources_acceptance(Eagle3DraftModel, tmp_path, load_reports):
    """The shipped drafter through speculators (load, save_pretrained) and back: the same weights, and served in the
    embedded engine on a fixed greedy run it drafts and is accepted exactly as the source is."""
    policy, tok = load_policy(str(PROJECT_ROOT / "checkpoints/policy"))
    src = load_drafter(PROJECT_ROOT / "checkpoints/eagle3")
    cfg = json.loads((PROJECT_ROOT / "checkpoints/eagle3/config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = str(PROJECT_ROOT / "checkpoints/policy")
    (tmp_path / "src").mkdir()
    (tmp_path / "src/config.json").write_text(json.dumps(cfg))
    (tmp_path / "src/model.safetensors").symlink_to(PROJECT_ROOT / "checkpoints/eagle3/model.safetensors")
    load_reports.clear()  # the policy's own load reported too
    m = Eagle3DraftModel.from_pretrained(str(tmp_path / "src"))
    (info,) = load_reports
    assert not info.missing_keys and not info.unexpected_keys and not info.mismatched_keys, info
    m.save_pretrained(str(tmp_path / "resaved"))
    got = load_drafter(tmp_path / "resaved")
    for name, t in src.state_dict().items():
        assert torch.equal(t, got.state_dict()[name]), name

    prompts = [encode_prompt(tok, p.prompt) for p in make_prompts(8, seed=11)]
    params = SamplingParams(temperature=0, max_new_tokens=32)
    runs = [build_engine(engine_cfg(k=4, drafter_int8=False), policy, d).generate(prompts, params)
            for d in (src, got)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].stats.to_dict() == runs[1].stats.to_dict()
    assert runs[0].stats.mean_accepted_length > 2.0  # a drafter that drafts well: the equality is not 0 == 0


def test_a_restricted_draft_vocabulary_loads_in_speculators(Eagle3DraftModel, tmp_path, policy, verifier,
                                                              load_reports):
    """A full-vocabulary drafter cut to its 20 most frequent tokens (vocab.draft_vocab, restrict_draft_vocab): its
    export loads in speculators with the same map and computes the full drafter's logits on those tokens."""
    from drafttrain.drafters.eagle3 import restrict_draft_vocab
    from drafttrain.drafters.vocab import draft_vocab

    full = drafter_for(policy, None, seed=6).eval()
    counts = torch.randint(0, 50, (policy.config.vocab_size,), generator=torch.Generator().manual_seed(7))
    ids = draft_vocab(counts, 20, keep=[2])
    d = restrict_draft_vocab(full, ids)
    out = save_drafter(d, tmp_path / "eagle3", verifier=verifier, k=STEPS)
    m = Eagle3DraftModel.from_pretrained(str(out)).eval()
    (info,) = load_reports
    assert not info.missing_keys and not info.unexpected_keys and not info.mismatched_keys, info
    assert torch.equal(m.d2t, d.d2t) and torch.equal(m.t2d, d.t2d) and int(m.t2d.sum()) == 20
    assert torch.equal(load_drafter(out).draft_ids(), ids)
    theirs, ours = both_logits(m, d, seed=8)
    _, whole = both_logits(m, full, seed=8)
    for i, (a, b, w) in enumerate(zip(theirs, ours, whole)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda s: f"TTT step {i}: {s}")
        torch.testing.assert_close(b, w[..., ids], atol=1e-5, rtol=0, msg=lambda s: f"TTT step {i}: {s}")
