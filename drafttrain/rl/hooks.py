"""The hooks API an RL loop calls: DraftTracker (drafttrain/tracking/tracker.py), re-exported here."""
from drafttrain.tracking.tracker import DraftTracker

__all__ = ["DraftTracker"]
