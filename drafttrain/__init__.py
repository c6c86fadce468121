"""drafttrain: keep speculative-decoding drafters fresh during RL post-training.

    from drafttrain import DraftTracker       # the hooks an RL loop calls each step
"""


def __getattr__(name):  # lazy, so `import drafttrain.spec` stays light
    if name == "DraftTracker":
        from drafttrain.tracking.tracker import DraftTracker

        return DraftTracker
    raise AttributeError(name)


__all__ = ["DraftTracker"]
