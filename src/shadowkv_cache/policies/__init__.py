"""Selection policies behind one interface (`SelectionPolicy`): ShadowKV's landmarks and the baselines."""

from .base import SelectionPolicy
from .landmark_topk import LandmarkTopK
from .oracle import OracleTopK
from .quantized_keys import QuantizedKeyTopK
from .quest import Quest
from .snapkv import SnapKV
from .streaming_llm import StreamingLLM

__all__ = ["LandmarkTopK", "OracleTopK", "QuantizedKeyTopK", "Quest", "SelectionPolicy", "SnapKV", "StreamingLLM"]
