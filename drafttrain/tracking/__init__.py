"""Online drafter training: hidden-state capture, the feature buffer, the drafter trainer."""
from drafttrain.tracking.buffer import FeatureBuffer
from drafttrain.tracking.capture import HiddenCapture, build_features, teacher_forced_features
from drafttrain.tracking.trainer import DrafterTrainer

__all__ = ["FeatureBuffer", "HiddenCapture", "build_features", "teacher_forced_features", "DrafterTrainer"]
