"""Prefix files that are damaged, mixed, signed, or written by a process that died (docs/prefix_format.md,
"Integrity"; docs/reliability.md): every failure is a `PrefixCacheError` before anything is built, a file that loads
is the file that was saved, and a save leaves no temporary behind and the usual permissions.
"""

from __future__ import annotations

import copy
import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import generate_with, make_tiny_model, random_prompt
from helpers import small_budget_overrides as small
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from shadowkv_cache import PrefixCacheError, ShadowKVCache, unpatch_model
from shadowkv_cache.prefix import FORMAT_VERSION, METADATA_KEY, held_file, integrity
from shadowkv_cache.prefix.errors import PrefixOptionError
from shadowkv_cache.prefix.format import STALE_AFTER_S, format_bytes
from shadowkv_cache.prefix.identity import forget_model_identity, identity_weights, model_identity

DOC = 160
KEY = b"k" * 32


@pytest.fixture(scope="module")
def model():
    model = make_tiny_model("llama")
    yield model
    unpatch_model(model)


@pytest.fixture(scope="module")
def document():
    return random_prompt(DOC, seed=700)[0]


@pytest.fixture(scope="module")
def saved(model, document, tmp_path_factory):
    path = tmp_path_factory.mktemp("integrity") / "doc.safetensors"
    ShadowKVCache.prefill(model, document, **small()).save_prefix(path)
    return path


def read(path: Path) -> tuple[dict, dict]:
    with safe_open(path, framework="pt") as f:
        return json.loads(f.metadata()[METADATA_KEY]), {name: f.get_tensor(name).clone() for name in f.keys()}


def write(path: Path, meta: dict, tensors: dict, key: bytes | None = None, reseal: bool = False) -> Path:
    """Save `meta` and `tensors`; with `reseal`, digests recomputed (a forger without the key, or with it)."""
    meta = copy.deepcopy(meta)
    if reseal:
        sealed = meta[integrity.FIELD]
        sealed["algorithm"] = integrity.KEYED if key is not None else integrity.UNKEYED
        token_hash = meta["token_ids_sha256"]
        sealed["tensors"] = {n: integrity.tensor_digest(key, token_hash, n, t) for n, t in tensors.items()}
        sealed["header"] = integrity.header_digest(key, meta)
    save_file(tensors, path, metadata={METADATA_KEY: json.dumps(meta)})
    return path


def data_offset(path: Path, name: str) -> int:
    """Where tensor `name`'s bytes start in the file."""
    raw = path.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + header_len])
    return 8 + header_len + header[name]["data_offsets"][0]


def ask(model, cache, document, n=4):
    ids = torch.cat([document, torch.tensor([5, 6, 7])])[None]
    return generate_with(model, ids, cache, max_new_tokens=n).sequences


# -- 3. the model identity covers every weight that shapes the keys and values --------------------------------


def test_the_identity_lists_the_embeddings_and_every_decoder_layer_weight(saved, model):
    meta, _ = read(saved)
    names = set(meta["model"]["weights"])
    expected = {n for n, _ in model.named_parameters() if n.startswith(("model.embed_tokens.", "model.layers."))}
    assert names == expected and len(names) == 1 + 2 * 9  # embeddings + 9 tensors per Llama layer
    assert "lm_head.weight" not in names and "model.norm.weight" not in names


SHAPING = [
    "model.embed_tokens.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.1.self_attn.k_proj.weight",
    "model.layers.1.self_attn.v_proj.weight",
]


@pytest.mark.parametrize("name", SHAPING)
def test_a_change_to_any_weight_that_shapes_keys_or_values_is_refused(saved, name):
    other = make_tiny_model("llama")  # the same seeded weights, then one tensor changed a little
    with torch.no_grad():
        dict(other.named_parameters())[name].mul_(1.001)
    with pytest.raises(PrefixCacheError, match=rf"other weights \(1 of 19 weight tensors differ, first \['{name}'\]"):
        ShadowKVCache.load_prefix(other, saved)
    unpatch_model(other)


@pytest.mark.parametrize("name", ["lm_head.weight", "model.norm.weight"])
def test_weights_after_the_last_layer_do_not_matter(saved, document, name):
    other = make_tiny_model("llama")
    with torch.no_grad():
        dict(other.named_parameters())[name].mul_(1.001)
    assert ShadowKVCache.load_prefix(other, saved).get_seq_length() == DOC
    unpatch_model(other)


def test_the_kept_identity_follows_in_place_writes_and_is_forgotten_on_request():
    model = make_tiny_model("llama")
    first = model_identity(model)
    assert model_identity(model)["weights"] == first["weights"]  # kept, not hashed again
    weight = model.model.layers[1].mlp.up_proj.weight
    with torch.no_grad():
        weight.mul_(2.0)  # bumps the parameter's version counter
    changed = model_identity(model)
    assert changed["weights_sha256"] != first["weights_sha256"]
    weight.data.div_(2.0)  # through .data: PyTorch does not count it (documented), until forgotten
    assert model_identity(model)["weights_sha256"] == changed["weights_sha256"]
    forget_model_identity(model)
    assert model_identity(model)["weights_sha256"] == first["weights_sha256"]
    model.model.layers[0].self_attn.k_proj.weight = torch.nn.Parameter(weight.new_zeros(32, 64))  # replaced
    assert model_identity(model)["weights_sha256"] != first["weights_sha256"]
    assert len(identity_weights(model)) == 19


# -- 4. digests of every tensor, NaN/inf, keys ------------------------------------------------------------------


def test_a_flipped_byte_in_any_tensor_is_found(saved, model, document, tmp_path):
    path = tmp_path / "flipped.safetensors"
    for name in ("layers.1.host_values", "layers.0.a", "layers.1.policy.landmarks", "layers.0.local_values"):
        raw = bytearray(saved.read_bytes())
        raw[data_offset(saved, name) + 5] ^= 0x10
        path.write_bytes(bytes(raw))
        with pytest.raises(PrefixCacheError, match=f"tensor {name} does not match its digest"):
            ShadowKVCache.load_prefix(model, path)
    # verify=False skips the digests (a file you trust); the structural checks still run.
    assert ShadowKVCache.load_prefix(model, path, verify=False).get_seq_length() == DOC


def test_a_tensor_from_another_document_does_not_verify(saved, model, tmp_path):
    other_path = tmp_path / "other.safetensors"
    ShadowKVCache.prefill(model, random_prompt(DOC, seed=701)[0], **small()).save_prefix(other_path)
    meta, tensors = read(saved)
    _, others = read(other_path)
    tensors["layers.0.host_values"] = others["layers.0.host_values"]  # same name, shape and dtype
    with pytest.raises(PrefixCacheError, match="layers.0.host_values does not match its digest"):
        ShadowKVCache.load_prefix(model, write(tmp_path / "mixed.safetensors", meta, tensors))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_floats_are_refused_even_with_matching_digests(saved, model, tmp_path, value):
    meta, tensors = read(saved)
    tensors["layers.1.b"][0, 0, 0, 3] = value
    path = write(tmp_path / "nan.safetensors", meta, tensors, reseal=True)
    with pytest.raises(PrefixCacheError, match=r"\['layers.1.b'\] hold NaN or inf"):
        ShadowKVCache.load_prefix(model, path)


def test_a_cache_with_non_finite_values_is_not_saved(model, document, tmp_path):
    doc = ShadowKVCache.prefill(model, document, **small())
    doc.layers[0].prompt.local_values[0, 0, 0, 0] = float("nan")
    with pytest.raises(PrefixCacheError, match="NaN or inf in"):
        doc.save_prefix(tmp_path / "nan.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_a_signed_file_needs_its_key(model, document, tmp_path):
    doc = ShadowKVCache.prefill(model, document, **small())
    path = tmp_path / "signed.safetensors"
    doc.save_prefix(path, key=KEY)
    meta, tensors = read(path)
    assert meta[integrity.FIELD]["algorithm"] == "hmac-sha256"
    with pytest.raises(PrefixCacheError, match="signed with a key"):
        ShadowKVCache.load_prefix(model, path)
    with pytest.raises(PrefixCacheError, match="signed with a key"):
        ShadowKVCache.load_prefix(model, path, verify=False)
    with pytest.raises(PrefixCacheError, match="HMAC does not match under this key"):
        ShadowKVCache.load_prefix(model, path, key=b"another key")
    loaded = ShadowKVCache.load_prefix(model, path, key=KEY)
    assert torch.equal(ask(model, loaded, document), ask(model, doc.fork(), document))

    # Someone without the key changes a tensor and reseals it without a key: a load with the key refuses it.
    tensors["layers.0.local_values"].add_(0.5)
    forged = write(tmp_path / "forged.safetensors", meta, tensors, key=None, reseal=True)
    with pytest.raises(PrefixCacheError, match="saved without a key"):
        ShadowKVCache.load_prefix(model, forged, key=KEY)
    # Or keeps the algorithm and guesses: the HMAC under the real key does not match.
    guessed = write(tmp_path / "guessed.safetensors", meta, tensors, key=b"a guess", reseal=True)
    with pytest.raises(PrefixCacheError, match="HMAC does not match"):
        ShadowKVCache.load_prefix(model, guessed, key=KEY)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"verify": "yes"}, "verify must be True or False"),
        ({"key": "text"}, "key must be non-empty bytes"),
        ({"key": b""}, "key must be non-empty bytes"),
        ({"key": KEY, "verify": False}, "needs verify=True"),
    ],
)
def test_bad_integrity_options_are_prefix_option_errors(saved, model, options, message):
    with pytest.raises(PrefixOptionError, match=message):
        ShadowKVCache.load_prefix(model, saved, **options)


@pytest.mark.parametrize("version, named", [(2, "version 2 predates the digests"), (4, "version 4 predates sliding")])
def test_an_older_file_is_refused_naming_its_version(saved, model, tmp_path, version, named):
    meta, tensors = read(saved)
    meta["version"] = version
    with pytest.raises(PrefixCacheError, match=f"{named}.*reads version {FORMAT_VERSION}"):
        ShadowKVCache.load_prefix(model, write(tmp_path / f"v{version}.safetensors", meta, tensors))


# -- 9. every loader failure is a PrefixCacheError, metadata fuzzed ---------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:4]):
            yield from _paths(v, (*prefix, i))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_metadata_loads_soundly_or_raises_prefix_cache_error(saved, model, tmp_path, data):
    """A random field of the metadata object (at any depth) replaced by random JSON or removed, with or without
    resealed digests, loaded with or without verification: `PrefixCacheError` and nothing else, or a sound cache."""
    meta, tensors = read(saved)
    paths = [p for p in _paths(meta) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(paths))
        parent = meta
        try:
            for step in where[:-1]:
                parent = parent[step]
            if data.draw(st.booleans()) and isinstance(parent, dict):
                parent.pop(where[-1], None)
            else:
                parent[where[-1]] = data.draw(JSON)
        except (KeyError, IndexError, TypeError):
            continue
    reseal = data.draw(st.booleans())
    try:
        path = write(tmp_path / "fuzzed.safetensors", meta, tensors, reseal=reseal)
    except (KeyError, TypeError, AttributeError, ValueError):
        return  # the edit broke what resealing needs (or JSON itself): no file to load
    verify = data.draw(st.booleans())
    try:
        cache = ShadowKVCache.load_prefix(model, path, verify=verify)
    except PrefixCacheError:
        return
    assert cache.get_seq_length() == DOC
    generate_with(model, torch.cat([cache.prefix_ids, torch.tensor([5])])[None], cache, max_new_tokens=2)


# -- 5. one file per load: concurrent writers and readers never mix two files ---------------------------------------


@pytest.mark.parametrize("named_open_file", [True, False], ids=["proc-fd", "recheck-path"])
def test_concurrent_saves_and_loads_never_mix_two_files(model, tmp_path, monkeypatch, named_open_file):
    """safetensors maps a file's tensors by path after reading its header: a load must still see one file, both where
    the system names open files (Linux) and where the load has to notice the replacement and read again."""
    if not named_open_file:
        monkeypatch.setattr(held_file, "open_file_name", lambda held: None)
    docs = [random_prompt(DOC, seed=710 + i)[0] for i in range(2)]
    caches = [ShadowKVCache.prefill(model, d, **small()) for d in docs]
    path = tmp_path / "shared.safetensors"
    caches[0].save_prefix(path)
    expected = {tuple(d.tolist()): c.layers[1].prompt.a.clone() for d, c in zip(docs, caches)}
    stop, errors, loads = threading.Event(), [], []

    def writer() -> None:
        i = 0
        while not stop.is_set():
            caches[i % 2].save_prefix(path)
            i += 1

    def reader() -> None:
        for _ in range(25):
            try:
                cache = ShadowKVCache.load_prefix(model, path)
            except Exception as err:  # noqa: BLE001 - any error is a failure here
                errors.append(err)
                continue
            ids = tuple(cache.prefix_ids.tolist())
            loads.append(ids in expected and torch.equal(cache.layers[1].prompt.a, expected[ids]))

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    # Without a name for the open file, a writer rewriting the file without pause can outrun the re-reads: that load
    # must then fail saying so, never return a mix.
    refused = [e for e in errors if isinstance(e, PrefixCacheError) and "was replaced 8 times" in str(e)]
    assert errors == refused if not named_open_file else not errors, errors[:2]
    assert len(loads) + len(errors) == 50 and all(loads) and loads
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared.safetensors"]


# -- 12. temporaries of dead writers; permissions; messages -----------------------------------------------------


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_stale_temporaries_of_dead_writers_are_removed_on_the_next_save(saved, model, document, tmp_path):
    dead, alive = _dead_pid(), os.getpid()
    old = time.time() - STALE_AFTER_S - 60
    files = {
        "stale": f".doc.safetensors.{dead}.0123456789abcdef.shadowkv-tmp",
        "fresh, dead writer": f".doc.safetensors.{dead}.fedcba9876543210.shadowkv-tmp",
        "live writer": f".doc.safetensors.{alive}.00112233445566ff.shadowkv-tmp",
        "not ours": f".doc.safetensors.{dead}.tmp",
    }
    for label, name in files.items():
        (tmp_path / name).write_bytes(b"half a file")
        if label != "fresh, dead writer":
            os.utime(tmp_path / name, (old, old))
    ShadowKVCache.prefill(model, document, **small()).save_prefix(tmp_path / "other.safetensors")
    left = {p.name for p in tmp_path.iterdir()}
    assert files["stale"] not in left
    assert {files["fresh, dead writer"], files["live writer"], files["not ours"], "other.safetensors"} <= left


KILLED_SAVE = """
import os, signal, sys
sys.path[:0] = {paths!r}
from helpers import make_tiny_model, random_prompt, small_budget_overrides
from shadowkv_cache import ShadowKVCache
from shadowkv_cache.prefix import format as fmt

def die(tensors, filename, metadata=None):
    open(filename, "wb").write(b"half a file")
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 in the middle of a save

fmt.save_file = die
model = make_tiny_model("llama")
ShadowKVCache.prefill(model, random_prompt(160, seed=700)[0], **small_budget_overrides()).save_prefix({path!r})
"""


def test_a_save_killed_mid_write_leaves_a_temporary_the_next_save_removes(model, document, tmp_path):
    tests = Path(__file__).resolve().parent
    path = tmp_path / "doc.safetensors"
    script = KILLED_SAVE.format(paths=[str(tests), str(tests.parent / "src")], path=str(path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == -9, done.stderr[-2000:]
    (left,) = list(tmp_path.iterdir())
    assert left.name.startswith(".doc.safetensors.") and left.name.endswith(".shadowkv-tmp")
    old = time.time() - STALE_AFTER_S - 60
    os.utime(left, (old, old))
    ShadowKVCache.prefill(model, document, **small()).save_prefix(path)
    assert [p.name for p in tmp_path.iterdir()] == ["doc.safetensors"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_saved_file_gets_the_usual_permissions(model, document, tmp_path, umask, mode):
    doc = ShadowKVCache.prefill(model, document, **small())
    before = os.umask(umask)
    try:
        doc.save_prefix(tmp_path / "doc.safetensors")
    finally:
        os.umask(before)
    assert (tmp_path / "doc.safetensors").stat().st_mode & 0o777 == mode


def test_the_disk_check_names_sizes_in_readable_units(model, document, tmp_path, monkeypatch):
    import shutil

    from shadowkv_cache.prefix import format as fmt

    monkeypatch.setattr(fmt.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(PrefixCacheError, match=r"needs \d+(\.\d+)? KiB but .* has 1000 B free"):
        ShadowKVCache.prefill(model, document, **small()).save_prefix(tmp_path / "doc.safetensors")
    assert [format_bytes(n) for n in (0, 1023, 1024, 1536, 5 * 2**30, 3 * 2**40)] == [
        "0 B",
        "1023 B",
        "1 KiB",
        "1.5 KiB",
        "5 GiB",
        "3 TiB",
    ]
