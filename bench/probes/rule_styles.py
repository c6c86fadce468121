"""Per-rule competence at T=1 (the shipped world): python rule_styles.py <policy> [n] [threads] -> json"""
import sys, re, json
import torch
from drafttrain.policy import load_policy, encode_prompt, decode
from drafttrain.policy.task import make_problems, reward, f, g, LABELS
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
path, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 512
model, tok = load_policy(path)
probs = make_problems(n, 999)
torch.manual_seed(0)
st = {"f": [0, 0], "g": [0, 0]}; lab = [0, 0]; rew, stop_ok, by_n, lens = [], [], {}, []
STEP = re.compile(r"^([a-p])([:-])(\d\d)$")
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
            text = decode(tok, row); lens.append(len(text))
            r = reward(p, text); rew.append(r)
            b = "n1" if p.n == 1 else "n2-3" if p.n <= 3 else "n4-6" if p.n <= 6 else "n7+"
            by_n.setdefault(b, []).append(r)
            parts = text.split(";")[:-1]; x = p.start; ok = True
            for i, part in enumerate(parts, start=1):
                m = STEP.match(part)
                if not m: ok = False; break
                rule = "g" if m[2] == "-" else "f"
                st[rule][0] += 1; st[rule][1] += int(m[3]) == (g(x) if rule == "g" else f(x))
                lab[0] += 1; lab[1] += m[1] == (LABELS[p.n - i] if p.n - i >= 0 else None)
                x = int(m[3])
            stop_ok.append(ok and len(parts) == p.n)
res = dict(acc=sum(rew) / n, wrong_rule_share=st["g"][0] / max(1, st["f"][0] + st["g"][0]),
           f_right=st["f"][1] / max(1, st["f"][0]), g_right=st["g"][1] / max(1, st["g"][0]),
           label_right=lab[1] / max(1, lab[0]), stop_right=sum(stop_ok) / n, mean_len=sum(lens) / n,
           acc_by_n={k: round(sum(v) / len(v), 3) for k, v in sorted(by_n.items())})
print(json.dumps(res))
