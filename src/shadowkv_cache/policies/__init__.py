"""Selection policies behind one interface (`SelectionPolicy`): ShadowKV's landmarks, YAKV's quantised keys (and
the study's two extensions) and the baselines."""

from .base import SelectionPolicy
from .landmark_topk import LandmarkTopK
from .oracle import OracleTopK
from .quantized_keys import QuantizedKeyTopK
from .quest import Quest
from .residual_landmarks import ResidualLandmarkTopK
from .shared_budget import SharedBudgetTopK
from .snapkv import SnapKV
from .streaming_llm import StreamingLLM

__all__ = [
    "LandmarkTopK",
    "OracleTopK",
    "QuantizedKeyTopK",
    "Quest",
    "ResidualLandmarkTopK",
    "SelectionPolicy",
    "SharedBudgetTopK",
    "SnapKV",
    "StreamingLLM",
]
