"""Per-style competence at T=1 in the iter world: python styles_iter.py <policy> [n] [threads]"""
import sys, re, json
import torch
from drafttrain.policy import load_policy, encode_prompt, decode
from drafttrain.policy.task import make_problems, reward, f, LABELS
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
path, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 512
model, tok = load_policy(path)
probs = make_problems(n, 999)
torch.manual_seed(0)
st = {s: [0, 0] for s in ("terse", "careful")}  # steps, f ok
lab = [0, 0]
rew, share, stop_ok, by_n = [], [], [], {}
STEP = re.compile(r"^(?:([a-p]):)?(\d\d)$")
with torch.inference_mode():
    order = sorted(range(n), key=lambda i: len(probs[i].prompt))
    for s in range(0, n, 64):
        chunk = [probs[i] for i in order[s:s + 64]]
        enc = [encode_prompt(tok, p.prompt) for p in chunk]
        T = max(map(len, enc))
        ids = torch.tensor([[tok.pad_token_id] * (T - len(e)) + e for e in enc])
        out = model.generate(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=120,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, T:]
        for p, row in zip(chunk, out.tolist()):
            text = decode(tok, row)
            r = reward(p, text); rew.append(r)
            b = "n1" if p.n == 1 else "n2-3" if p.n <= 3 else "n4-6" if p.n <= 6 else "n7+"
            by_n.setdefault(b, []).append(r)
            parts = text.split(";")[:-1]
            x, nc = p.start, 0
            for i, part in enumerate(parts, start=1):
                m = STEP.match(part)
                if not m:
                    break
                sty = "careful" if m[1] else "terse"; nc += bool(m[1])
                st[sty][0] += 1; st[sty][1] += int(m[2]) == f(x)
                if m[1]:
                    lab[0] += 1; lab[1] += m[1] == (LABELS[p.n - i] if p.n - i >= 0 else None)
                x = int(m[2])
            stop_ok.append(len(parts) == p.n)
            if parts: share.append(nc / len(parts))
res = {"accuracy": round(sum(rew) / n, 3), "careful_share": round(sum(share) / len(share), 3),
       "stop_ok": round(sum(stop_ok) / n, 3), "label_ok": round(lab[1] / max(lab[0], 1), 3),
       "f_ok": {k: round(v[1] / max(v[0], 1), 3) for k, v in st.items()},
       "acc_by_n": {k: (round(sum(v) / len(v), 3), len(v)) for k, v in sorted(by_n.items())}}
print(json.dumps(res))
