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
