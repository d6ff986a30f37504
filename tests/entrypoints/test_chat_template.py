"""Chat templates render in a child process bounded in time, memory and output; the parent survives."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.chat_template import TemplateError, TemplateLimitError, TemplateRenderer

CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def renderer():
    r = TemplateRenderer(timeout=1.0, max_chars=100_000, max_memory=512 * 2**20)
    yield r
    r.close()


def test_renders_like_jinja(renderer):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "héllo ✓"}]
    want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhéllo ✓<|im_end|>\n"
    assert renderer.render(CHATML, {"messages": msgs}) == want
    assert renderer.render("{{ x | tojson }}", {"x": {"a": [1, 2]}}) == '{"a": [1, 2]}'


@pytest.mark.parametrize("source, limit", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}", True),  # output
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", True),  # time
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
     True),  # memory
    ("{{ 'a' * 10000000000 }}", True),
    ("{{ raise_exception('no system role') }}", False),
    ("{% for %}", False),
    ("{{ ''.__class__.__mro__ }}", False),  # the sandbox refuses internals
])
def test_hostile_or_broken_templates_fail_cleanly(renderer, source, limit):
    with pytest.raises(TemplateLimitError if limit else TemplateError) as e:
        renderer.render(source, {"messages": []})
    assert "chat template" in str(e.value)
    assert renderer.render("{{ 1 + 1 }}", {}) == "2"  # the renderer still works after (restarted if killed)


def test_tokenizer_reports_template_failures_as_invalid_request(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from pagedllm.errors import InvalidRequestError
    from pagedllm.tokenizer import Tokenizer

    tok = Tokenizer(HFTokenizer(models.BPE()), chat_template=CHATML)
    tok.renderer.timeout = 1.0
    assert tok.apply_chat_template([{"role": "user", "content": "a"}], add_generation_prompt=False).endswith("a<|im_end|>\n")
    with pytest.raises(InvalidRequestError, match="took over"):
        tok.apply_chat_template([], chat_template="{% for i in range(100000) %}{% for j in range(100000) %}"
                                                  "{% endfor %}{% endfor %}")
