"""Ideal-frozen MAL: the step-0 policy as drafter on the later policy's rollouts.

    python drift.py <p0> <p1> [n] [threads]
"""
import sys, json
import torch
from drafttrain.policy import load_policy, encode_prompt, decode
from drafttrain.policy.task import make_problems, reward
from drafttrain.spec import expected_spec_stats
p0path, p1path = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 256
torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 1)
K = 5
m0, tok = load_policy(p0path)
probs = make_problems(n, 4242)
def rollouts(model, seed):
    torch.manual_seed(seed)
    enc = [encode_prompt(tok, p.prompt) for p in probs]
    res = []
    with torch.inference_mode():
        for s in range(0, n, 64):
            e = enc[s:s + 64]; T = max(map(len, e))
            ids = torch.tensor([[tok.pad_token_id] * (T - len(x)) + x for x in e])
            out = model.generate(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=200,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, T:]
            for x, row in zip(e, out.tolist()):
                r = row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
                res.append((x, r))
    return res
@torch.inference_mode()
def ideal_mal(target, rows):
    accs = []
    from drafttrain.spec import SpecStats
    st = SpecStats()
    for x, r in rows:
        ids = torch.tensor([x + r])
        lp = target(ids).logits.log_softmax(-1)[0]
        lq = m0(ids).logits.log_softmax(-1)[0]
        P = len(x); R = len(r)
        nxt = ids[0, 1:]
        # position j (0-based in full seq) predicts token j+1; response tokens are at P..P+R-1, predicted by P-1..
        rho = (lq[:-1].gather(-1, nxt[:, None]) - lp[:-1].gather(-1, nxt[:, None])).squeeze(-1).exp().clamp(max=1)
        # drafter positions t: r[t, i] = rho at position t+1+i ; valid[j] = position j predicts a response token
        T = len(x) + R - 1
        rhop = torch.cat([rho, torch.zeros(K + 2)])
        rr = torch.stack([rhop[torch.arange(T) + 1 + i] for i in range(K)], -1)[None]  # [1, T, K]
        valid = torch.zeros(1, T + K + 1, dtype=torch.bool); valid[0, P - 1: P - 1 + R] = True
        st = st.merge(expected_spec_stats(rr, valid, K))
    return st.mean_accepted_length
m1, _ = load_policy(p1path)
r0, r1 = rollouts(m0, 1), rollouts(m1, 1)
acc0 = sum(reward(p, decode(tok, r)) for p, (x, r) in zip(probs, r0)) / n
acc1 = sum(reward(p, decode(tok, r)) for p, (x, r) in zip(probs, r1)) / n
a0, a1 = ideal_mal(m0, r0), ideal_mal(m1, r1)
print(json.dumps(dict(acc0=acc0, acc1=acc1, mal_on_p0=a0, mal_on_p1=a1, decay_pct=100 * (1 - a1 / a0),
                      len0=sum(len(r) for _, r in r0) / n, len1=sum(len(r) for _, r in r1) / n)))
