"""Online drafter training: hidden-state capture, the feature buffer, the drafter trainer."""
from drafttrain.online.buffer import FeatureBuffer
from drafttrain.online.capture import HiddenCapture, build_features, teacher_forced_features
from drafttrain.online.trainer import DrafterTrainer

__all__ = ["FeatureBuffer", "HiddenCapture", "build_features", "teacher_forced_features", "DrafterTrainer"]
