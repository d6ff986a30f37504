"""The GGUF tokenizer against HF's, incremental detokenization, chat template."""

from __future__ import annotations

import pytest

from pagedllm.bench.hf_folder import gguf_to_hf_folder
from pagedllm.model_executor.model_loader import default_model_path
from pagedllm.tokenizer import IncrementalDetokenizer, Tokenizer

MULTILINGUAL = [
    "The capital of France is Paris.",
    "Grüße aus München! Ça va? ¿Qué tal? 1234567 + 89 = 1234656",
    "東京は日本の首都です。北京是中国的首都。",
    "Здравствуйте, мир! Γειά σου Κόσμε! مرحبا بالعالم שלום עולם",
    "emoji: 🦙🚀👩‍💻  tabs\tand\nnewlines   spaces",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return x**2  # ok\n",
]


@pytest.fixture(scope="module")
def gguf_tok() -> Tokenizer:
    tok = Tokenizer.from_dir(gguf_to_hf_folder(default_model_path()))
    assert tok is not None
    return tok


def test_gguf_tokenizer_matches_hf_built_from_same_gguf(gguf_tok):
    from transformers import AutoTokenizer

    path = default_model_path()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in MULTILINGUAL:
        assert gguf_tok.encode(text) == hf.encode(text, add_special_tokens=True), text
        ids = gguf_tok.encode(text)
        assert gguf_tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_special_tokens_and_template(gguf_tok):
    assert gguf_tok.eos_token == "<|im_end|>" and gguf_tok.eos_token_id == 2
    assert gguf_tok.encode("<|im_start|>") == [1]
    text = gguf_tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_incremental_detokenization_equals_full_decode(gguf_tok, text):
    ids = gguf_tok.encode(text)
    d = IncrementalDetokenizer(gguf_tok, skip_special_tokens=True)
    streamed = "".join(d.add(i) for i in ids) + d.flush()
    assert streamed == gguf_tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in streamed


def test_split_multibyte_characters_never_leak_replacement_chars(gguf_tok):
    # byte-level tokens of one emoji, fed one by one: nothing shows until the character is whole
    ids = gguf_tok.encode("🦙")
    assert len(ids) > 1
    d = IncrementalDetokenizer(gguf_tok)
    deltas = [d.add(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🦙"


def test_a_gguf_vocabulary_its_merges_do_not_fit_is_a_clear_error():
    """A merge naming a token the vocabulary lacks: a ValueError the loader turns into a warning (token-id prompts
    only), not the tokenizers library's bare Exception, which would fail the whole load."""
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["t0", "t1"], "tokenizer.ggml.merges": ["t 0"]}
    with pytest.raises(ValueError, match="vocabulary and merges do not fit"):
        Tokenizer.from_gguf_metadata(meta)


def _write_vocab_gguf(path, arch: str, model: str, tokens: list[str], types: list[int], scores=None, merges=None,
                      pre: str | None = None) -> dict:
    """A GGUF holding a vocabulary (and the least of a model transformers' reader needs); its tokenizer metadata."""
    import numpy as np
    from gguf import GGUFWriter

    from pagedllm.model_executor.model_loader.gguf import read_gguf_metadata
    from pagedllm.model_executor.model_loader.gguf_file import open_gguf

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    w.add_context_length(64)
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: v for k, v in read_gguf_metadata(open_gguf(path)).items() if k.startswith("tokenizer.")}


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_a_sentencepiece_gguf_vocabulary_tokenizes_as_transformers_reads_it(tmp_path, arch):
    """tokenizer.ggml.model 'llama' (Llama 2, Mistral, Phi-3, Gemma): merges recovered from the scores, byte
    fallback, each architecture's handling of leading and repeated spaces, BOS added as llama.cpp does."""
    from transformers import AutoTokenizer

    pieces = ["▁", "t", "h", "e", "c", "a", "s", "i", "o", "n", "▁t", "he", "▁the", "at", "▁c", "▁cat", "▁is", "is",
              "on", "▁on", "▁a", "▁mat", "ma", "mat", "m", "."]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    meta = _write_vocab_gguf(tmp_path / f"{arch}.gguf", arch, "llama", tokens, [2, 3, 3] + [6] * 256 + [1] * len(pieces),
                             scores=[0.0] * 259 + [-float(i) for i in range(len(pieces))])
    ours = Tokenizer.from_gguf_metadata(meta, arch)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f"{arch}.gguf")
    for text in ["the cat is on the mat.", " the  cat", "hé ☃ x"]:
        ids = ours.encode(text)
        assert ids == hf.encode(text) and ids[0] == 1, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_a_gemma4_gguf_vocabulary_tokenizes_as_transformers_reads_it(tmp_path):
    """tokenizer.ggml.model 'gemma4': spaces spelled ▁ with no prefix space, the file's own merges, bytes outside
    the vocabulary through <0xXX> tokens, no BOS added (Gemma 4's chat template writes it)."""
    from transformers import AutoTokenizer

    pieces = ["▁", "t", "h", "e", "c", "a", "he", "the", "at", "▁c", "▁cat", "\n"]
    merges = ["h e", "t he", "a t", "▁ c", "▁c at"]
    tokens = ["<pad>", "<bos>", "<eos>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    meta = _write_vocab_gguf(tmp_path / "gemma4.gguf", "gemma4", "gemma4", tokens, [3, 3, 3] + [6] * 256 + [1] * len(pieces),
                             scores=[0.0] * len(tokens), merges=merges)
    ours = Tokenizer.from_gguf_metadata(meta, "gemma4")
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="gemma4.gguf")
    the, cat, space = (tokens.index(t) for t in ("the", "▁cat", "▁"))
    assert ours.encode("the cat") == [the, cat]  # no BOS, no prefix ▁ before "the"
    assert ours.encode(" the") == [space, the]
    assert ours.encode("é")[0] == 3 + 0xC3  # a byte the vocabulary lacks: its <0xXX> token
    for text in ["the cat", " the  cat\nthe", "hé ☃ x"]:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text


def test_a_byte_level_gguf_vocabulary_splits_as_its_pre_tokenizer_names():
    """`tokenizer.ggml.pre` 'llama-bpe' (Llama 3): digits split in threes before the merges, as transformers reads
    the file; GPT-2's split (no `pre`) keeps the run whole."""
    import tempfile
    from pathlib import Path

    from transformers import AutoTokenizer

    from pagedllm.tokenizer import _bytes_to_unicode

    alphabet = list(_bytes_to_unicode().values())
    merges = ["1 2", "12 3", "123 4", "4 5"]
    tokens = ["<unk>", "<s>", "</s>", *alphabet, "12", "123", "1234", "45"]
    types = [2, 3, 3] + [1] * (len(tokens) - 3)
    with tempfile.TemporaryDirectory() as tmp:
        llama3 = _write_vocab_gguf(Path(tmp) / "l3.gguf", "llama", "gpt2", tokens, types, merges=merges, pre="llama-bpe")
        gpt2 = _write_vocab_gguf(Path(tmp) / "g2.gguf", "llama", "gpt2", tokens, types, merges=merges)
        hf = AutoTokenizer.from_pretrained(tmp, gguf_file="l3.gguf")
        ours = Tokenizer.from_gguf_metadata(llama3, "llama")
        ids = ours.encode("12345", add_special_tokens=False)
        assert [ours.decode([i]) for i in ids] == ["123", "45"]
        assert ids == hf.encode("12345", add_special_tokens=False)
        plain = Tokenizer.from_gguf_metadata(gpt2, "llama")
        assert [plain.decode([i]) for i in plain.encode("12345", add_special_tokens=False)] == ["1234", "5"]


def test_a_gguf_ends_generation_where_llama_cpp_does():
    """A GGUF keeps one EOS id, but chat models end turns with other tokens (Gemma's <end_of_turn>, Llama 3's
    <|eot_id|> / <|eom_id|>, gpt-oss's <|call|>): llama.cpp's end-of-generation set, by the file's eot / eom ids
    and the tokens' spelling; with <|return|> and <|call|> in the vocabulary, <|end|> is not in it (it closes a
    Harmony message mid-answer). The default model's <|endoftext|> joins its <|im_end|>."""
    from pagedllm.tokenizer import gguf_end_of_generation

    gemma = {"tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>", "hi", "<start_of_turn>", "<end_of_turn>"],
             "tokenizer.ggml.eos_token_id": 1}
    assert gguf_end_of_generation(gemma) == [1, 5]
    llama3 = {"tokenizer.ggml.tokens": ["a", "<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>",
                                        "<|custom_stop|>"], "tokenizer.ggml.eot_token_id": 5}
    assert gguf_end_of_generation(llama3) == [2, 3, 4, 5]
    harmony = {"tokenizer.ggml.tokens": ["<|start|>", "<|end|>", "<|return|>", "<|call|>", "<|message|>"]}
    assert gguf_end_of_generation(harmony) == [2, 3]
    phi3 = {"tokenizer.ggml.tokens": ["<unk>", "<|endoftext|>", "<|end|>", "<|user|>"]}
    assert gguf_end_of_generation(phi3) == [1, 2]
    assert gguf_end_of_generation({"tokenizer.ggml.tokens": ["x"], "tokenizer.ggml.eom_token_id": 7}) == []
    import json

    from pagedllm.model_executor.model_loader import load_model

    assert load_model(None).tokenizer.eos_token_ids == {0, 2}
    exported = gguf_to_hf_folder(default_model_path()) / "generation_config.json"  # for HF-only peers
    assert json.loads(exported.read_text())["eos_token_id"] == [0, 2]
