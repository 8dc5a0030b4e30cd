"""Prefix files: a document's compressed state saved to safetensors and loaded into new caches, and the checks when a
prefix is used (`batch_questions` builds a batch of questions over one document).

`format.py` names the format and writes files, `read.py` checks and reads them (`held_file.py`: from one file while
writers replace it), `layout.py` says which tensors a file holds, `identity.py` what identifies the model, `use.py`
what is checked when a prefix is used.
"""

from .errors import PrefixCacheError
from .format import FORMAT_VERSION, METADATA_KEY, write_prefix
from .identity import model_identity, token_ids_sha256
from .read import PrefixState, read_prefix
from .use import as_prefix_ids, batch_questions, check_prefix_ids, ids_to_save, refuse_pads_after_prefix

__all__ = [
    "FORMAT_VERSION",
    "METADATA_KEY",
    "PrefixCacheError",
    "PrefixState",
    "as_prefix_ids",
    "batch_questions",
    "check_prefix_ids",
    "ids_to_save",
    "model_identity",
    "read_prefix",
    "refuse_pads_after_prefix",
    "token_ids_sha256",
    "write_prefix",
]
