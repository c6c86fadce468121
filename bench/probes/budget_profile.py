"""python budget_profile.py recipe=eagle3_track run.out_dir=DIR: one main job with the tracker's methods wrapped by
timers -> seconds and calls per method (capture sink, buffer add, drafter steps, estimate, publish, measure)."""
import sys, time, collections, json
from drafttrain.tracking import tracker as T, scoring as S, trainer as TR, buffer as B, hotswap as H
acc = collections.defaultdict(float); cnt = collections.Counter()
def wrap(cls, name, key):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[key] += time.perf_counter() - t; cnt[key] += 1
    setattr(cls, name, g)
wrap(TR.DrafterTrainer, 'step', 'train_step')
wrap(S.Scorer, 'estimate', 'estimate')
wrap(S.Scorer, 'serving_scores', 'serving_scores')
wrap(S.Scorer, 'keep_heldout', 'keep_heldout')
wrap(S.Scorer, 'estimate_rows', 'estimate_rows')
wrap(H.Publisher, 'publish', 'publish')
wrap(T.DraftTracker, '_keep', 'keep(capture-sink)')
wrap(B.FeatureBuffer, 'add', 'buffer_add')
wrap(B.FeatureBuffer, 'sample_groups', 'sample_groups')
wrap(T.DraftTracker, '_update', 'update_total')
wrap(S.Scorer, 'runtime_form', 'runtime_form')
import drafttrain.tracking.scoring as SS
_tfa = SS.teacher_forced_acceptance
def tfa(*a, **k):
    t = time.perf_counter()
    try: return _tfa(*a, **k)
    finally: acc['tfa'] += time.perf_counter() - t; cnt['tfa'] += 1
SS.teacher_forced_acceptance = tfa
wrap(S.Scorer, 'measure', 'measure')
from drafttrain.online import cli
cli(sys.argv[1:])
print(json.dumps({k: [round(v, 3), cnt[k]] for k, v in acc.items()}, indent=1))
