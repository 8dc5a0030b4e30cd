"""Selection policies behind one interface (`SelectionPolicy`)."""

from .base import SelectionPolicy
from .landmark_topk import LandmarkTopK

__all__ = ["LandmarkTopK", "SelectionPolicy"]
