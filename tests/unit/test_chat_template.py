"""Chat templates render exactly as transformers' ``apply_chat_template`` does, for the templates that ship
(SmolLM2's in its GGUF, the tiny model's) and common ones written into a tokenizer_config here."""

from __future__ import annotations

import json
import shutil

import pytest

from distserve.server.engine.chat_template import PLAIN_TEMPLATE, ChatTemplate, ChatTemplateError, end_of_turn_ids
from distserve.server.engine.loader import load_tokenizer
from distserve.server.engine.tokenizer import Tokenizer
from distserve.server.router import protocol

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama 2 chat (as published in its tokenizer_config.json): bos/eos variables, raise_exception, strip
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
# Llama 3 instruct: whitespace control, trim filter, bos variable
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# block tags on their own lines: trim_blocks/lstrip_blocks decide the output; tojson on a dict
BLOCKS = """{% for message in messages %}
    {% if message['role'] == 'system' %}
[SYS] {{ message['content'] | tojson }}
    {% else %}
<{{ message['role'] }}> {{ message['content'] }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<assistant>
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": 'Be brief. "Quotes" and é'},
        {"role": "user", "content": "  Hi  "},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Two\nlines"},
    ],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from distserve.server.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", layers=1, hidden=64, heads=2, kv_heads=2)


def _with_template(folder, tiny, template: str | None, as_file: bool = False):
    """A copy of the tiny model whose tokenizer_config (or chat_template.jinja) carries ``template``."""
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(tiny, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    if template is not None and not as_file:
        cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    if template is not None and as_file:
        (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.mark.parametrize(
    "name,template,as_file",
    [
        ("smollm2", SMOLLM2, False),
        ("llama2", LLAMA2, False),
        ("llama3", LLAMA3, True),
        ("blocks", BLOCKS, False),
        ("tiny", "TINY", False),
    ],
)
def test_render_equals_transformers(tmp_path, tiny, name, template, as_file):
    from transformers import AutoTokenizer

    if template == "TINY":
        template = json.loads((tiny / "tokenizer_config.json").read_text())["chat_template"]
    folder = _with_template(tmp_path / name, tiny, template, as_file)
    ours = ChatTemplate.for_tokenizer(Tokenizer.from_folder(folder))
    ref = AutoTokenizer.from_pretrained(folder)
    for msgs in CONVERSATIONS:
        if name == "llama2" and msgs[-1]["role"] != "user":
            continue
        want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert ours.render(msgs) == want
        assert ours.render(msgs, add_generation_prompt=False) == ref.apply_chat_template(msgs, tokenize=False)


def test_template_errors_are_request_errors(tmp_path, tiny):
    folder = _with_template(tmp_path / "l2", tiny, LLAMA2)
    t = ChatTemplate.for_tokenizer(Tokenizer.from_folder(folder))
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_sandbox_blocks_attribute_escapes():
    t = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        t.render([{"role": "user", "content": "x"}])


def test_no_template_falls_back_to_the_plain_format(tmp_path, tiny):
    folder = _with_template(tmp_path / "none", tiny, None)
    tok = Tokenizer.from_folder(folder)
    assert tok.chat_template is None
    msgs = [protocol.ChatMessage(role="system", content="be brief"), protocol.ChatMessage(role="user", content="hi")]
    assert ChatTemplate.for_tokenizer(tok).render([m.template_dict() for m in msgs]) == protocol.render_chat(msgs)
    assert ChatTemplate(PLAIN_TEMPLATE).source == PLAIN_TEMPLATE


def test_end_of_turn_ids(tmp_path, tiny):
    gguf = pytest.importorskip("gguf")  # noqa: F841 - the writer below needs it
    from tests.unit.test_gguf import write_gguf

    path = tmp_path / "m.gguf"
    write_gguf(path, seed=5)
    tok = load_tokenizer(path)
    assert end_of_turn_ids(tok, ChatTemplate.for_tokenizer(tok)) == [2]  # <|im_end|> is the file's eos
    t = ChatTemplate("{{ '<|im_start|>' }}{{ '<|im_end|>' }}")
    tok_tiny = Tokenizer.from_folder(tiny)
    assert end_of_turn_ids(tok_tiny, t) == list(tok_tiny.eos_token_ids)  # not in this vocabulary: nothing added


@pytest.mark.parametrize("name,template", [("smollm2", SMOLLM2), ("llama2", LLAMA2), ("llama3", LLAMA3)])
def test_developer_role_is_the_system_role_for_templates_without_it(name, template):
    """OpenAI's ``developer`` role is its newer name for ``system``: a template that knows no ``developer``
    renders it as its system turn (SmolLM2's used to add its own default system prompt and then an unknown
    "developer" turn; Llama 2's refused the conversation)."""
    t = ChatTemplate(template, {"bos_token": "<s>", "eos_token": "</s>"})
    dev = [protocol.ChatMessage(role="developer", content="Be terse."), protocol.ChatMessage(role="user", content="Hi")]
    sys = [protocol.ChatMessage(role="system", content="Be terse."), protocol.ChatMessage(role="user", content="Hi")]
    assert t.render(protocol.template_messages(dev, t.source)) == t.render([m.template_dict() for m in sys])
    # a template that names the role gets it as sent
    knows = ChatTemplate("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}{# developer #}")
    assert knows.render(protocol.template_messages(dev, knows.source)) == "developer:Be terse.;user:Hi;"
