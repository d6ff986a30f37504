"""Tokenizer, chat template and incremental detokenization.

Built on the `tokenizers` library: from a folder's tokenizer.json, or from a GGUF file's vocabulary (byte-level BPE
split as its `pre` names, or SentencePiece as transformers' GGUF loader rebuilds it). Chat templates render with a
sandboxed jinja2 in a bounded child process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .entrypoints.chat_template import TemplateError, TemplateRenderer
from .errors import InvalidRequestError
from .limits import check_unicode

GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4
_LONG_TEXT = 8192  # characters: ~2 ms of encoding, past which holding the GIL stalls the other threads

# A GGUF names one EOS token, but a chat model ends its turns with others (Gemma's <end_of_turn> beside <eos>, Llama
# 3's <|eot_id|> and <|eom_id|>, gpt-oss's <|call|> beside <|return|>), which an HF folder lists in
# generation_config.json and a GGUF does not carry. llama.cpp ends generation on the file's eos / eot / eom ids and
# on any token spelled as one of these (llama-vocab.cpp); so does a GGUF here.
GGUF_END_OF_GENERATION = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})


def gguf_end_of_generation(meta: dict) -> list[int]:
    """The token ids that end a GGUF model's generation beside its EOS, as llama.cpp reads them: the file's eot and
    eom ids and the tokens spelled as GGUF_END_OF_GENERATION. Where a vocabulary has <|return|> and <|call|> (or
    <|calls|> and <|flush|>), <|end|> closes a message inside the answer (gpt-oss's Harmony) and does not end it."""
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    ids = {i: t for i, t in enumerate(tokens) if t in GGUF_END_OF_GENERATION}
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        i = meta.get(key)
        if i is not None and 0 <= i < len(tokens):
            ids[i] = tokens[i]
    spelled = set(ids.values())
    if {"<|return|>", "<|call|>"} <= spelled or {"<|calls|>", "<|flush|>"} <= spelled:
        ids = {i: t for i, t in ids.items() if t != "<|end|>"}
    return sorted(ids)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _token_str(t: Any) -> str | None:
    if t is None or isinstance(t, str):
        return t
    if isinstance(t, dict):
        return t.get("content")
    return None


class Tokenizer:
    def __init__(self, tok: HFTokenizer, bos_token: str | None = None, eos_token: str | None = None,
                 chat_template: str | None = None, add_bos: bool = False,
                 extra_eos_ids: list[int] | None = None) -> None:
        self.tok = tok
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tok.token_to_id(eos_token) if eos_token else None
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.eos_token_ids = {i for i in [self.eos_token_id, *(extra_eos_ids or [])] if i is not None}
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        # the most characters one token stands for: a text longer than n times this has over n tokens
        self.max_token_chars = max(map(len, tok.get_vocab(with_added_tokens=True)), default=1)
        self.renderer = TemplateRenderer()

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: Path, eos_ids: list[int] | None = None) -> Tokenizer | None:
        tj = path / "tokenizer.json"
        if not tj.exists():
            return None
        tok = HFTokenizer.from_file(str(tj))
        cfg: dict = {}
        if (path / "tokenizer_config.json").exists():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        return cls(tok, _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token")), template,
                   add_bos=False, extra_eos_ids=eos_ids)

    @classmethod
    def from_gguf_metadata(cls, meta: dict, architecture: str | None = None) -> Tokenizer:
        """meta: the tokenizer.ggml.* fields of a GGUF file: byte-level BPE ('gpt2') or SentencePiece ('llama':
        Llama 2, Mistral, Phi-3, Gemma; architecture: the file's, whose quirks the vocabulary follows)."""
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
        if kind == "gpt2":
            tok = _byte_level_bpe(meta)
        elif kind in ("llama", "gemma4"):
            tok = _sentencepiece(meta, architecture)
        else:
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2', SentencePiece "
                             "'llama', Gemma 4's 'gemma4')")

        def name(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        # llama.cpp adds BOS for a SentencePiece vocabulary that does not say otherwise; Gemma 4's chat template
        # writes its own, and its reference tokenizer adds none (llama.cpp forces one on; transformers does not)
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and kind != "gemma4"
        return cls(tok, name("bos_token_id"), name("eos_token_id"), meta.get("tokenizer.chat_template"),
                   add_bos=bool(add_bos), extra_eos_ids=gguf_end_of_generation(meta))

    def save(self, path: Path) -> None:
        self.tok.save(str(path / "tokenizer.json"))
        cfg = {"bos_token": self.bos_token, "eos_token": self.eos_token, "chat_template": self.chat_template,
               "add_bos_token": self.add_bos}
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))

    # ---- use -----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Token ids of text. max_tokens: refuse (InvalidRequestError) a text that is surely longer, by
        its length alone, before any of it is tokenized. Text that is not valid Unicode is refused too."""
        if max_tokens is not None and len(text) > max_tokens * self.max_token_chars:
            raise InvalidRequestError(f"text of {len(text)} characters is over {max_tokens} tokens")
        try:
            if len(text) > _LONG_TEXT:  # encode_batch releases the GIL: other threads (the engine step) keep running
                ids = self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            else:
                ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            check_unicode(text, "text")
            raise
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        """Render in the bounded child process (chat_template.py); any failure is an InvalidRequestError."""
        template = chat_template or self.chat_template
        if not template:
            raise InvalidRequestError("this model has no chat template; use generate() with a plain prompt")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise InvalidRequestError("each chat message must be a dict with 'role' and 'content'")
        context = {**kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt,
                   "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        try:
            return self.renderer.render(template, context)
        except TemplateError as e:
            raise InvalidRequestError(str(e)) from e


class IncrementalDetokenizer:
    """Text of a growing token list, one token at a time. A chunk of text is released only
    when it ends on a whole character, so multi-byte UTF-8 split across tokens never shows as
    a replacement character; the concatenation equals decoding the whole list at once."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        self.tokens.append(token_id)
        dec = self.tokenizer.decode
        prefix = dec(self.tokens[self.prefix_offset:self.read_offset], self.skip)
        full = dec(self.tokens[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever bytes are still pending (possibly incomplete UTF-8)."""
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset:self.read_offset], self.skip)
        full = self.tokenizer.decode(self.tokens[self.prefix_offset:], self.skip)
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.text += delta
        return delta


def _byte_level_bpe(meta: dict) -> HFTokenizer:
    """A GGUF's byte-level BPE: tokens in GPT-2's byte spelling, its merges, split first as its `pre` names
    (Llama 3, Qwen2, gpt-4o, ...: the regexes transformers keeps for them; GPT-2's otherwise)."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    try:
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False))
    except Exception as e:  # tokenizers raises a bare Exception for an inconsistent vocabulary
        raise ValueError(f"the GGUF's BPE vocabulary and merges do not fit together ({e})") from e
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == GGUF_CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == GGUF_USER_DEFINED and t in vocab])
    split = _pre_tokenizer_splits().get(meta.get("tokenizer.ggml.pre"))
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


def _pre_tokenizer_splits() -> dict[str, str]:
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:  # an older transformers: GPT-2's split for every vocabulary
        return {}
    return GGUF_PRE_TOKENIZER_SPLITS


def _sentencepiece(meta: dict, architecture: str | None) -> HFTokenizer:
    """A GGUF's SentencePiece vocabulary (tokens, scores, types; merges derived from the scores where the file
    has none), with its architecture's quirks (Gemma's spelling of space runs, Phi-3's prefix space), or Gemma 4's
    ('gemma4': ▁ for spaces, the file's merges, no split but newlines): built as transformers' GGUF loader builds
    it, the reference llama.cpp's files are read against."""
    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping as m
    except ImportError as e:
        raise ValueError(f"SentencePiece GGUF vocabularies need transformers' GGUF support ({e})") from e
    kind = meta.get("tokenizer.ggml.model")
    d = {"tokenizer_type": kind, "tokens": meta["tokenizer.ggml.tokens"], "scores": meta.get("tokenizer.ggml.scores"),
         "token_type": meta.get("tokenizer.ggml.token_type")}
    if meta.get("tokenizer.ggml.merges"):
        d["merges"] = meta["tokenizer.ggml.merges"]
    if kind == "gemma4":
        build = getattr(m, "GGUF_TOKENIZER_TYPES", {}).get(kind)
        if build is None or "merges" not in d:
            raise ValueError("a 'gemma4' GGUF vocabulary needs its merges and transformers 5's builder for it")
        return m.add_gguf_special_tokens(build(d), d).backend_tokenizer
    build = m.GGUF_SENTENCEPIECE_BUILDERS.get(architecture, m.sentencepiece_tokenizer)
    return m.add_gguf_special_tokens(build(d), d).backend_tokenizer
