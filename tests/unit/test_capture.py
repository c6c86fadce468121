"""Online pieces on tiny random models: HiddenCapture, build_features, FeatureBuffer, DrafterTrainer."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from drafttrain.config import Config
from drafttrain.drafters import TargetHead
from drafttrain.tracking import DrafterTrainer, FeatureBuffer, HiddenCapture, build_features
from drafttrain.tracking.buffer import collate
from drafttrain.tracking.capture import PolicyCapture, choose_rows, teacher_forced_features

STEPS = 2


def _cfgs(**train):
    c = OmegaConf.structured(Config)
    c.drafter.path, c.drafter.ttt_steps = None, STEPS
    for k, v in train.items():
        setattr(c.train, k, v)
    return c


def _fresh_drafter(policy, seed=1):
    from drafttrain.drafters import build_drafter

    torch.manual_seed(seed)
    return build_drafter(_cfgs().drafter, policy)


def _features(policy, drafter, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 32, (3 + i % 3,), generator=g).tolist() for i in range(n)]
    resp = [torch.randint(4, 32, (6 + 2 * i,), generator=g).tolist() for i in range(n)]
    return teacher_forced_features(policy, prompts, resp, drafter.aux_layer_ids, STEPS)


# ---- capture ---------------------------------------------------------------------------------------------
def test_capture_equals_hf_hidden_states_in_one_forward(policy):
    ids = torch.randint(0, 32, (2, 9))
    calls = []
    h = policy.register_forward_hook(lambda *a: calls.append(1))
    try:
        with HiddenCapture(policy, [3, 1]) as cap:  # any order in, layer order out
            out = policy(ids)
        feats = cap.features()
    finally:
        h.remove()
    assert len(calls) == 1
    ref = policy(ids, output_hidden_states=True).hidden_states
    assert torch.equal(feats, torch.cat([ref[1], ref[3]], -1))
    assert not feats.requires_grad and out.logits.shape == (2, 9, 32)


def test_choose_rows_keeps_every_held_out_row_and_a_share_of_the_rest():
    g = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    idx, held = choose_rows(4000, 0.1, 1.0, g(0), g(1))
    assert idx is None and torch.equal(held, torch.rand(4000, generator=g(0)) < 0.1)  # all rows: as before
    idx, held = choose_rows(4000, 0.1, 0.25, g(0), g(1))
    every = torch.rand(4000, generator=g(0)) < 0.1
    assert set(idx[held].tolist()) == set(every.nonzero().flatten().tolist())  # each held-out row kept
    assert len(held) == len(idx) and abs((~held).sum().item() / (~every).sum().item() - 0.25) < 0.03
    idx, held = choose_rows(8, 0.0, 1e-9, g(0), g(1))
    assert idx.numel() == 0 and held.numel() == 0


def test_policy_capture_of_some_rows_equals_those_rows_of_a_full_capture(policy):
    from drafttrain.drafters.contract import Reads

    ids = torch.randint(4, 32, (5, 9), generator=torch.Generator().manual_seed(0))
    got = {}
    for name, rows in (("all", None), ("some", lambda B: torch.tensor([1, 3])), ("none", lambda B: torch.tensor([]))):
        out = []
        cap = PolicyCapture(policy, Reads(aux_layers=(1, 2)), STEPS, lambda f, t0: out.append(f), lambda: 0.0,
                            response_start=4, rows=rows).start()
        try:
            with torch.no_grad():
                policy(input_ids=ids)
        finally:
            cap.stop()
        got[name] = out
    assert got["none"] == [] and len(got["all"]) == len(got["some"]) == 1
    full, some = got["all"][0], got["some"][0]
    for k in ("aux", "hidden", "next_ids", "valid", "lengths", "start"):
        torch.testing.assert_close(some[k], full[k][[1, 3]], msg=k)
    ref = policy.model(input_ids=ids).last_hidden_state  # the targets' source: the final hidden state
    torch.testing.assert_close(full["hidden"], ref)


def test_capture_hooks_removed_even_on_error(policy):
    layers = policy.model.layers
    before = [len(layer._forward_pre_hooks) for layer in layers]
    with pytest.raises(RuntimeError, match="boom"):
        with HiddenCapture(policy, [0, 2]):
            raise RuntimeError("boom")
    assert [len(layer._forward_pre_hooks) for layer in layers] == before
    with HiddenCapture(policy, [0, 2]) as cap:
        policy(torch.randint(0, 32, (1, 4)))
    assert [len(layer._forward_pre_hooks) for layer in layers] == before
    policy(torch.randint(0, 32, (1, 7)))  # a forward after exit does not touch the capture
    assert cap.features().shape == (1, 4, 2 * 64)


def test_capture_rejects_bad_layers(policy):
    with pytest.raises(ValueError, match="layer_ids"):
        HiddenCapture(policy, [1, 4])
    with pytest.raises(RuntimeError, match="nothing captured"):
        with HiddenCapture(policy, [1]) as cap:
            pass
        cap.features()


def test_build_features_alignment_and_left_padding():
    B, T, H, X = 2, 6, 5, 3
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [0, 0, 7, 8, 9, 10]])
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    aux = torch.randn(B, T, X)
    hidden = torch.randn(B, T, H)
    f = build_features(ids, mask, aux, hidden, steps=2, response_start=torch.tensor([2, 4]))
    assert f["aux"].shape == (2, 6, 3) and f["next_ids"].shape == (2, 7) and f["hidden"].shape == (2, 6, 5)
    assert f["next_ids"][0, :5].tolist() == [2, 3, 4, 5, 6] and f["next_ids"][1, :3].tolist() == [8, 9, 10]
    assert torch.equal(f["aux"][1, :4], aux[1, 2:])  # left padding removed
    assert torch.equal(f["hidden"][1, :4], hidden[1, 2:]) and not f["hidden"][1, 4:].any()
    assert f["start"].tolist() == [2, 2] and f["first_ids"].tolist() == [1, 7]
    # row 0: prompt [1, 2], response from column 2: positions 1..4 predict response tokens 2..5
    assert f["valid"][0].nonzero().flatten().tolist() == [1, 2, 3, 4]
    # row 1 (shifted): prompt [7, 8], response [9, 10]: positions 1, 2
    assert f["valid"][1].nonzero().flatten().tolist() == [1, 2]
    assert f["lengths"].tolist() == [6, 4]


def test_build_features_right_and_left_padding_agree_and_leave_the_input_alone():
    """Right padding (the RL loss forward's) takes a slice, left padding a row-wise index: the same rows in either
    layout give the same features, padding zeroed, the caller's aux untouched."""
    g = torch.Generator().manual_seed(0)
    lengths = [6, 3, 5]
    B, T, H, X = len(lengths), 7, 5, 4
    rows = [torch.randint(1, 9, (n,), generator=g) for n in lengths]
    feats = [torch.randn(n, X, generator=g) for n in lengths]
    hid = [torch.randn(n, H, generator=g) for n in lengths]
    out = {}
    for side in ("right", "left"):
        ids, mask = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
        aux, hidden = torch.full((B, T, X), 7.0), torch.full((B, T, H), 7.0)  # padding 7: must not reach them
        for b, n in enumerate(lengths):
            c = slice(0, n) if side == "right" else slice(T - n, T)
            ids[b, c], mask[b, c], aux[b, c], hidden[b, c] = rows[b], 1, feats[b], hid[b]
        before = aux.clone()
        start = torch.tensor([2, 1, 2]) + (0 if side == "right" else T - torch.tensor(lengths))
        out[side] = build_features(ids, mask, aux, hidden, steps=2, response_start=start)
        assert torch.equal(aux, before), side
    for k in ("aux", "hidden", "next_ids", "valid", "lengths", "start", "first_ids"):
        assert torch.equal(out["right"][k], out["left"][k]), k
    a = out["right"]["aux"]
    assert a.shape == (B, max(lengths), X) and a.dtype == torch.float32
    assert torch.equal(a[1, :3], feats[1]) and not a[1, 3:].any()  # a short row's padding is zero


# ---- buffer ----------------------------------------------------------------------------------------------
def test_buffer_cap_eviction_sampling_and_state(policy, drafter):
    f = _features(policy, drafter, n=4)
    one = FeatureBuffer(1 << 30, torch.bfloat16)
    one.add(f)
    per_seq = one.nbytes / 4
    buf = FeatureBuffer(int(per_seq * 5), torch.float16, seed=3)
    buf.add(f)
    buf.add(_features(policy, drafter, n=4, seed=1))
    assert len(buf) < 8 and buf.nbytes <= buf.max_bytes and buf.evicted == 8 - len(buf)
    assert buf.records[0]["aux"].dtype == torch.float16
    b = buf.sample(3)
    assert b["aux"].dtype == torch.float32 and b["aux"].shape[0] == 3
    assert b["next_ids"].shape[1] == b["aux"].shape[1] + STEPS - 1 and b["valid"].shape[1] == b["aux"].shape[1] + 2
    assert buf.sample(100)["aux"].shape[0] == len(buf)
    # the newest records survive eviction: the last record equals the last row of the second batch
    g = _features(policy, drafter, n=4, seed=1)
    L = int(g["lengths"][-1])
    assert torch.allclose(buf.records[-1]["aux"].float(), g["aux"][-1, :L], rtol=1e-2, atol=1e-2)
    # state round trip continues the same draws
    copy = FeatureBuffer(buf.max_bytes, torch.float16)
    copy.load_state_dict(buf.state_dict())
    x, y = buf.sample(2), copy.sample(2)
    assert all(torch.equal(x[k], y[k]) for k in x)


def test_buffer_sample_groups_groups_by_length(policy, drafter):
    buf = FeatureBuffer(1 << 30, seed=0)
    buf.add(_features(policy, drafter, n=8))
    bs = [collate(g, buf.steps) for g in buf.sample_groups(3, 4)]  # 8 records -> groups of 3, 3, 2
    assert sorted(len(b["lengths"]) for b in bs) == [2, 3, 3]
    lengths = sorted(L for b in bs for L in b["lengths"].tolist())
    assert lengths == sorted(r["aux"].shape[0] for r in buf.records)  # each record exactly once
    spans = sorted((int(b["lengths"].min()), int(b["lengths"].max())) for b in bs)
    assert all(hi <= lo2 for (_, hi), (lo2, _) in zip(spans, spans[1:]))  # groups do not interleave


def test_buffer_draws_favour_recent_policy_versions(policy, drafter):
    # half_life h: a record v versions older than the newest is drawn with weight 0.5^(v/h); uniform without it
    f = _features(policy, drafter, n=4)
    recent = FeatureBuffer(1 << 30, seed=0, half_life=1.0)
    uniform = FeatureBuffer(1 << 30, seed=0)
    for v in range(4):  # 4 records from each of versions 0..3
        recent.add(f, version=v)
        uniform.add(f, version=v)
    assert [r["version"] for r in recent.records] == [v for v in range(4) for _ in range(4)]

    def newest_share(buf, n=2000):
        draws = [buf._draw(list(buf.records), 1)[0] for _ in range(n)]
        return sum(buf.records[i]["version"] == 3 for i in draws) / n
    want = 1 / (1 + 0.5 + 0.25 + 0.125)  # the newest version's share of the weight
    assert abs(newest_share(recent) - want) < 0.05
    assert abs(newest_share(uniform) - 0.25) < 0.05
    assert sorted(recent._draw(list(recent.records), 100)) == list(range(16))  # without replacement: each once
    assert len(recent.sample_groups(3, 2)) == 2
    copy = FeatureBuffer(1 << 30, half_life=1.0)  # the state round trip keeps each record's version
    copy.load_state_dict(recent.state_dict())
    assert [r["version"] for r in copy.records] == [r["version"] for r in recent.records]
    with pytest.raises(ValueError, match="online.buffer_half_life"):
        FeatureBuffer(1 << 30, half_life=0.0)


def test_held_out_records_are_stored_but_never_drawn_for_training(policy, drafter):
    f = _features(policy, drafter, n=8)
    held = torch.tensor([True, False, True, False, False, False, False, True])
    buf = FeatureBuffer(1 << 30, seed=0)
    assert buf.add(f, version=3, heldout=held) == 8
    assert len(buf) == 8 and buf.trainable() == 5 and len(buf.of_version(3)) == 8 and buf.of_version(2) == []
    assert [r["heldout"] for r in buf.records] == held.tolist()
    drawn = [r for g in buf.sample_groups(2, 10) for r in g]
    assert len(drawn) == 5 and not any(r["heldout"] for r in drawn)
    assert buf.sample(100)["aux"].shape[0] == 5


def test_a_record_stores_no_distribution_and_its_bytes_do_not_grow_with_the_vocabulary(drafter):
    """(X + H) x 2 + 4 bytes a token at bf16 for any vocabulary: the same rows of two policies that differ only in
    their vocabulary (32 and 4096 tokens) store the same bytes."""
    from tests.conftest import tiny_policy

    sizes = []
    for V in (32, 4096):
        pol = tiny_policy(vocab=V, seed=0)
        buf = FeatureBuffer(1 << 30)
        buf.add(_features(pol, drafter, n=4))
        L = sum(r["ids"].numel() for r in buf.records)
        X, H = buf.records[0]["aux"].shape[1], buf.records[0]["hidden"].shape[1]
        assert buf.nbytes == L * ((X + H) * 2 + 4)
        assert set(buf.records[0]) == {"aux", "hidden", "ids", "start", "version", "heldout"}
        sizes.append(buf.nbytes)
    assert sizes[0] == sizes[1]


def test_a_row_larger_than_the_buffer_and_a_step_it_cannot_hold_are_said_once(policy, drafter):
    f = _features(policy, drafter, n=4)
    one = FeatureBuffer(1 << 30)
    one.add(f)
    rows = sorted(r["aux"].shape[0] for r in one.records)
    small = FeatureBuffer(int(one.nbytes * 0.6))  # room for some rows of the step, not all
    small.add(f, version=0)
    notes = small.notes(0, step=0)
    assert len(notes) == 1 and "holds" in notes[0] and "of the 4 rows captured at step 0" in notes[0]
    assert notes[0].startswith("online.buffer_mb:") and "\n" not in notes[0]
    small.add(f, version=1)
    assert small.notes(1, step=1) == []  # said once a run
    tiny = FeatureBuffer(int(one.nbytes / 4 * rows[0] / sum(rows)))  # smaller than any one row
    assert tiny.add(f) == 0 and len(tiny) == 0 and tiny.too_big == 4
    assert any("more than the whole buffer" in n for n in tiny.notes(0, step=0))


def test_an_old_checkpoints_buffer_of_distributions_is_dropped_with_one_line(policy, drafter):
    buf = FeatureBuffer(1 << 30, seed=2)
    buf.add(_features(policy, drafter))
    old = buf.state_dict()
    old.pop("format")
    old["records"] = [{"aux": r["aux"], "next_ids": r["ids"], "target_probs": torch.zeros(3, 32), "version": 0}
                      for r in old["records"]]
    fresh = FeatureBuffer(1 << 30)
    note = fresh.load_state_dict(old)
    assert len(fresh) == 0 and fresh.nbytes == 0 and fresh.added == buf.added
    assert note.startswith("online.buffer_mb:") and "distributions" in note and "\n" not in note
    assert FeatureBuffer(1 << 30).load_state_dict(buf.state_dict()) is None


def test_train_max_len_trains_long_records_on_a_window_in_their_response(policy, drafter):
    f = _features(policy, drafter, n=4)
    buf = FeatureBuffer(1 << 30, torch.float32, seed=0)
    buf.add(f)
    long = max(buf.records, key=lambda r: r["aux"].shape[0])
    L, start = long["aux"].shape[0], long["start"]
    assert L > 8
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        b = collate([long], STEPS, max_len=6, gen=g)
        assert b["aux"].shape[1] == 6 and b["valid"][0, :5].all()  # every position of the window predicts a response
        w = next(i for i in range(L - 5) if torch.equal(b["aux"][0], long["aux"][i:i + 6]))
        assert start - 1 <= w <= L - 6 or w == L - 6
        assert torch.equal(b["next_ids"][0, :5], long["ids"][w + 1:w + 6].long())
        assert torch.equal(b["hidden"][0], long["hidden"][w:w + 6])
    short = min(buf.records, key=lambda r: r["aux"].shape[0])
    assert collate([short], STEPS, max_len=100)["aux"].shape[1] == short["aux"].shape[0]  # no longer: as it is


@pytest.mark.parametrize("size", [0, -5])
def test_buffer_size_error_names_field(size):
    with pytest.raises(ValueError, match="online.buffer_mb"):
        FeatureBuffer(size)
    with pytest.raises(ValueError, match="my.key"):
        FeatureBuffer(size, name="my.key")


# ---- trainer ---------------------------------------------------------------------------------------------
def test_trainer_lowers_loss(policy):
    d = _fresh_drafter(policy)
    c = _cfgs(lr=3e-3)
    tr = DrafterTrainer(d, c.train, c.drafter, head=TargetHead.of(policy))
    batch = _features(policy, d, n=4)
    first = tr.step(batch)
    for _ in range(15):
        out = tr.step(batch)
    assert not out["nonfinite"] and out["loss"] < first["loss"] - 0.3 and len(out["acc"]) == STEPS
    assert out["grad_norm"] > 0 and tr.step_count == 16


def test_trainer_skips_nonfinite_batch(policy):
    d = _fresh_drafter(policy)
    c = _cfgs()
    tr = DrafterTrainer(d, c.train, c.drafter, head=TargetHead.of(policy))
    batch = _features(policy, d)
    tr.step(batch)
    w = {k: v.clone() for k, v in d.state_dict().items()}
    opt_state = {k: v["exp_avg"].clone() for k, v in tr.opt.state_dict()["state"].items()}
    bad = dict(batch, aux=batch["aux"].clone())
    bad["aux"][0, 0, 0] = float("nan")
    out = tr.step(bad)
    assert out["nonfinite"] and tr.step_count == 1
    assert all(torch.equal(w[k], v) for k, v in d.state_dict().items())
    assert all(torch.equal(opt_state[k], v["exp_avg"]) for k, v in tr.opt.state_dict()["state"].items())
    assert not tr.step(batch)["nonfinite"] and tr.step_count == 2


def test_trainer_save_load_resumes(policy, tmp_path):
    c = _cfgs()
    d = _fresh_drafter(policy)
    buf = FeatureBuffer(1 << 30, seed=5)
    buf.add(_features(policy, d))
    tr = DrafterTrainer(d, c.train, c.drafter, buffer=buf, head=TargetHead.of(policy))
    for _ in range(3):
        tr.step(buf.sample(2))
    tr.save(tmp_path / "s" / "trainer.pt", extra={"cursor": 7})
    assert [p.name for p in (tmp_path / "s").iterdir()] == ["trainer.pt"]  # no temp file left
    ref = tr.step(buf.sample(2))

    d2 = _fresh_drafter(policy, seed=9)
    buf2 = FeatureBuffer(1 << 30, seed=0)
    tr2 = DrafterTrainer(d2, c.train, c.drafter, buffer=buf2, head=TargetHead.of(policy))
    assert tr2.load(tmp_path / "s" / "trainer.pt") == {"cursor": 7}
    assert tr2.step_count == 3 and len(buf2) == len(buf)
    out = tr2.step(buf2.sample(2))  # same batch, same weights, same Adam moments -> same update
    assert out["step"] == 4 and out["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert all(torch.allclose(a, b) for a, b in zip(d.state_dict().values(), d2.state_dict().values()))
