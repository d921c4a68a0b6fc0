"""Paired: eagle3+ngram with the controller sizing trees by Thompson draws vs by posterior means."""
import sys, json, collections
sys.path.insert(0, "/work/main")
import selfspec
from selfspec.control import Controller, ControlConfig
from selfspec.drafters import drafter_from_spec
from selfspec.measurement import benchmark as B
from selfspec.measurement.workloads import load_questions
T = float(sys.argv[1]); out = sys.argv[2]; qfile = sys.argv[3]; per = int(sys.argv[4])
model, tok = selfspec.load_target("smollm2-135m-instruct", dtype="bfloat16")
qs = load_questions(qfile)
seen, picked = collections.Counter(), []
for q in qs:
    if seen[q.category] < per: picked.append(q); seen[q.category] += 1
picked = [q.__class__(q.question_id, q.category, q.turns[:1]) for q in picked]
methods = {}
for name, sizing in (("draws", "draws"), ("means", "means")):
    m = B.method_from_spec(model, "eagle3+ngram", target="smollm2-135m-instruct", tokenizer=tok)
    m.controller = Controller(m.controller.members, ControlConfig(sizing=sizing))
    methods[name] = m
recs = B.run(model, tok, picked, methods, max_new_tokens=128, temperature=T, seed=int(sys.argv[5]) if len(sys.argv) > 5 else 0, progress=False)
B.write_report(out, {"temperature": T, "questions": qfile}, recs, "python scripts/dev/sizing_means.py " + " ".join(sys.argv[1:]), title="sizing by draws vs means")
s = B.summarise(recs)
print(B.markdown_table(s).splitlines()[-4:])
print("means/draws", B.ratio_ci(recs, "means", "draws"))
