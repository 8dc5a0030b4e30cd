"""Chat with a model over one ShadowKVCache, streaming the answers; optionally about a long document.

The whole conversation lives in one cache. Each turn applies the chat template to the whole conversation and passes
`generate` the full ids; the cache already holds all but the new turn, so only the new turn is run (one multi-token
step over the compressed document, then sparse decoding). A document (`--document FILE`) goes into the system
message, is prefilled once (with a progress bar) and compressed; `/save` writes its compressed state next to it
(`FILE.shadowkv.safetensors`), and later runs load that file instead of prefilling, after checking that it holds
this document for this model and these settings.

    python examples/chat.py                                   # the embedded SmolLM2-135M-Instruct
    python examples/chat.py --document DOCUMENT               # answers about a text file
    python examples/chat.py --model Qwen/Qwen2.5-0.5B-Instruct --device cuda --dtype bfloat16
    python examples/chat.py --document DOCUMENT --turns TURNS   # one user turn per line, no prompt
    python examples/chat.py --document DOCUMENT --mode yakv     # questions that need many scattered facts
    echo "What is the vault code?" | python examples/chat.py --document DOCUMENT

Commands: /reset (forget the conversation, keep the document), /memory (the cache's memory report), /save (write
the document's prefix file), /help, /quit. Prompts shorter than `--min-compress-len` (4096 by default) stay exact.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

from shadowkv_cache import PrefixCacheError, ShadowKVCache, ShadowKVConfig

HELP = """Commands:
  /reset   forget the conversation (the document stays loaded)
  /memory  print the cache's memory report
  /save    save the document's compressed prefix next to it, for later runs
  /help    this text
  /quit    leave (also Ctrl-D)"""
SYSTEM = "Answer the user's questions about the following document.\n\n"
_SPLIT = "\x00SHADOWKV_DOCUMENT_END\x00"


def prefix_path(document: Path) -> Path:
    """Where the compressed prefix of `document` is kept: `FILE.shadowkv.safetensors` beside it."""
    return document.with_name(document.name + ".shadowkv.safetensors")


def load_model(name: str | None, device: str, dtype: torch.dtype):
    """The embedded SmolLM2-135M-Instruct when `name` is None, else a local folder or a Hub id."""
    if name is None:
        from shadowkv_cache.embedded_models import load_smollm2

        return load_smollm2(dtype=dtype, device=device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval(), tokenizer


class Conversation:
    """The messages so far and their token ids; the part that holds the document is tokenised once.

    The document sits at the end of the system message, so every rendering of the conversation starts with the same
    text up to the document's end. That text is tokenised on its own (the prefix the cache holds) and the rest of
    each rendering after it, so every turn's ids start with exactly the prefix ids.
    """

    def __init__(self, tokenizer, document: str | None):
        self.tokenizer = tokenizer
        self.system = None if document is None else SYSTEM + document.strip()
        self.messages: list[dict] = []
        self.head = ""  # rendered text the prefix ids stand for
        self.prefix_ids = torch.zeros(0, dtype=torch.long)
        if self.system is not None:
            marked = [{"role": "system", "content": self.system + _SPLIT}, {"role": "user", "content": "?"}]
            probe = self._render(marked)
            self.head = probe.split(_SPLIT)[0]
            self.prefix_ids = self._tokenize(self.head)

    def _render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _tokenize(self, text: str) -> torch.Tensor:
        return self.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]

    def ids(self) -> torch.Tensor:
        """`[1, T]` ids of the whole conversation, ending with the assistant's turn opening."""
        system = [] if self.system is None else [{"role": "system", "content": self.system}]
        text = self._render(system + self.messages)
        if not text.startswith(self.head):
            raise RuntimeError("The chat template does not render the document as the start of every conversation.")
        return torch.cat([self.prefix_ids, self._tokenize(text[len(self.head) :])])[None]


class StopFlag(StoppingCriteria):
    """Ends `generate` at the next step once set (Ctrl-C while an answer streams)."""

    def __init__(self):
        self.event = threading.Event()

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class ChatSession:
    def __init__(self, model, tokenizer, args):
        self.model, self.tokenizer, self.args = model, tokenizer, args
        # The settings that shape a compressed document, defaults included, so that a saved prefix made with other
        # ones is refused (and the document prefilled again) rather than loaded with its own.
        defaults = ShadowKVConfig()
        self.options = {
            "mode": args.mode or defaults.mode,
            "min_compress_len": args.min_compress_len or defaults.min_compress_len,
            "rank": args.rank if args.rank is not None else defaults.rank,
        }
        if args.sparse_budget is not None:
            self.options["sparse_budget"] = args.sparse_budget
        if not args.document:  # nothing to compress: the conversation stays exact, which needs no notice
            logging.getLogger("shadowkv_cache").addFilter(lambda record: "kept the prompt exact" not in record.msg)
        text = args.document.read_text() if args.document else None
        self.conversation = Conversation(tokenizer, text)
        self.document: ShadowKVCache | None = None  # the document alone; each conversation forks it
        if args.document:
            self.document = self._load_or_prefill(args.document)
        self.reset()

    def _load_or_prefill(self, path: Path) -> ShadowKVCache:
        ids = self.conversation.prefix_ids
        saved = prefix_path(path)
        if saved.exists():
            start = time.perf_counter()
            try:
                document = ShadowKVCache.load_prefix(self.model, saved, **self.options)
                if not torch.equal(document.prefix_ids, ids):
                    raise PrefixCacheError("it holds another text (the document or the system message changed)")
                print(f"Loaded the {len(ids)}-token document from {saved} in {time.perf_counter() - start:.1f} s.")
                return document
            except PrefixCacheError as err:
                print(f"Not using {saved}: {str(err).rstrip('.')}. Prefilling the document instead.")
        start = time.perf_counter()
        document = ShadowKVCache.prefill(self.model, ids, progress=True, **self.options)
        report = document.memory_report()
        compressed = sum(layer.compressed for layer in report.layers)
        state = f"compressed in {compressed} of {len(report.layers)} layers" if compressed else "kept exact"
        print(f"Prefilled the {len(ids)}-token document in {time.perf_counter() - start:.1f} s ({state}).")
        return document

    def reset(self) -> None:
        self.conversation.messages = []
        self.cache = self.document.fork() if self.document is not None else ShadowKVCache(self.model, **self.options)
        self.held = self.conversation.prefix_ids  # the ids the cache holds

    def save(self) -> str:
        if self.document is None:
            return "No document to save: start with --document FILE."
        path = prefix_path(self.args.document)
        self.document.save_prefix(path)
        return f"Saved the document's prefix to {path} ({path.stat().st_size / 2**20:.1f} MiB)."

    def ask(self, text: str, out=sys.stdout) -> str:
        """Answer `text` as the next user turn, streaming the answer to `out`; returns it."""
        self.conversation.messages.append({"role": "user", "content": text})
        ids = self.conversation.ids()
        # The cache must hold a prefix of these ids. A re-rendered earlier answer may tokenise differently from what
        # was generated: drop the cached tokens from the first difference on (never the compressed document).
        held = self.held[: self.cache.get_seq_length()]
        same = int((held == ids[0, : len(held)]).long().cumprod(0).sum()) if len(held) < ids.shape[1] else 0
        if same < len(held):
            self.cache.crop(same - len(held))
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        stop = StopFlag()
        result: dict = {}

        def run() -> None:
            try:
                result["ids"] = self.model.generate(
                    ids.to(self.model.device),
                    attention_mask=torch.ones_like(ids, device=self.model.device),
                    max_new_tokens=self.args.max_new_tokens,
                    do_sample=False,
                    streamer=streamer,
                    stopping_criteria=StoppingCriteriaList([stop]),
                    pad_token_id=pad_id(self.tokenizer),
                    **{cache_argument(self.model): self.cache},
                )
            except BaseException as err:  # reported in the main thread
                result["error"] = err
                streamer.end()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        pieces = []
        try:
            for piece in streamer:
                pieces.append(piece)
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            stop.event.set()
            for piece in streamer:  # drain what was generated before the stop
                pieces.append(piece)
        thread.join()
        out.write("\n")
        if "error" in result:
            self.conversation.messages.pop()
            raise result["error"]
        self.held = result["ids"][0].cpu()
        answer = "".join(pieces)
        self.conversation.messages.append({"role": "assistant", "content": answer})
        return answer

    def command(self, line: str, out=sys.stdout) -> bool:
        """Run a /command; False to quit."""
        name = line.split()[0].lower()
        if name in ("/quit", "/exit"):
            return False
        if name == "/reset":
            self.reset()
            print("Conversation reset" + (" (the document stays loaded)." if self.document else "."), file=out)
        elif name == "/memory":
            print(self.cache.memory_report(), file=out)
        elif name == "/save":
            print(self.save(), file=out)
        elif name == "/help":
            print(HELP, file=out)
        else:
            print(f"Unknown command {name}; /help lists them.", file=out)
        return True


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def cache_argument(model) -> str:
    # Newer Transformers (5.24) call generate's cache argument `cache` and warn on `past_key_values`; 5.17 knows only
    # `past_key_values`.
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def setting(text: str) -> int | float | str:
    """A numeric setting as ShadowKVConfig takes it: an int, a float share, or a rule name ("auto")."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def turns_from(args) -> list[str] | None:
    """The user turns of a non-interactive run (`--turns FILE`, or stdin when it is not a terminal), else None."""
    if args.turns is not None:
        lines = args.turns.read_text().splitlines()
    elif not sys.stdin.isatty():
        lines = sys.stdin.read().splitlines()
    else:
        return None
    return [line.strip() for line in lines if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local folder or Hub id (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--document", type=Path, help="a text file to talk about (prefilled once and compressed)")
    parser.add_argument("--turns", type=Path, help="user turns, one per line (non-interactive)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: fp32 on CPU, else bf16")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--min-compress-len", type=int, help="prompts shorter than this stay exact (ShadowKV's default: 4096)"
    )
    parser.add_argument(
        "--mode",
        choices=["shadowkv", "yakv"],
        help="yakv: 4-bit keys and values, tokens selected one by one, for context-intensive questions (docs/yakv.md)",
    )
    parser.add_argument(
        "--rank", type=setting, help="rank of the key factors: an int, a share of Hkv*D in (0, 1], or auto (default)"
    )
    parser.add_argument(
        "--sparse-budget", type=setting, help="tokens selected per KV head and step: an int, or a share in (0, 1)"
    )
    args = parser.parse_args(argv)
    if args.document is not None and not args.document.is_file():
        parser.error(f"--document {args.document}: no such file.")
    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cpu" else "bfloat16"))

    model, tokenizer = load_model(args.model, args.device, dtype)
    if not getattr(tokenizer, "chat_template", None):
        parser.error(f"{args.model} has no chat template: use an instruction-tuned (chat) model.")
    try:
        session = ChatSession(model, tokenizer, args)
    except (ValueError, TypeError, NotImplementedError, PrefixCacheError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    turns = turns_from(args)
    if turns is None:
        print("Type a message, or /help for commands.")
    lines = iter(turns) if turns is not None else None
    while True:
        try:
            line = next(lines) if lines is not None else input("> ")
        except (StopIteration, EOFError):
            break
        except KeyboardInterrupt:
            print()
            break
        line = line.strip()
        if not line:
            continue
        if turns is not None:
            print(f"> {line}")
        if line.startswith("/"):
            if not session.command(line):
                break
            continue
        session.ask(line)
        if turns is None:
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
