"""ChatTokenizer: the chat template, compiled once, renders each call's own messages and
variables, and its raise_exception refuses a prompt with the template's message."""

import json

import pytest

from dflash_jax.tokenizer import ChatTokenizer
from test_serve import write_char_tokenizer

TEMPLATE = ("{% if messages[0]['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
            "{% if greet %}hi {% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture
def tokenizer(tmp_path):
    write_char_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>", "chat_template": TEMPLATE}))
    return ChatTokenizer(tmp_path)


def test_each_call_renders_its_own_messages_and_variables(tokenizer):
    first = tokenizer.encode([{"role": "user", "content": "ab"}], {"greet": True})
    second = tokenizer.encode([{"role": "user", "content": "cd"}])
    assert first == tokenizer.encode_text("hi user: ab\nassistant:")
    assert second == tokenizer.encode_text("user: cd\nassistant:")  # no greeting left from the call before


def test_template_variables_may_drop_the_generation_prompt_but_not_replace_the_messages(tokenizer):
    messages = [{"role": "user", "content": "ab"}]
    assert tokenizer.encode(messages, {"add_generation_prompt": False}) == tokenizer.encode_text("user: ab\n")
    with pytest.raises(ValueError, match="may not set 'messages'"):
        tokenizer.encode(messages, {"messages": []})


def test_the_template_refuses_with_its_own_message_every_time(tokenizer):
    for _ in range(2):
        with pytest.raises(ValueError, match="the chat template refused the prompt: no tools here"):
            tokenizer.encode([{"role": "tool", "content": "x"}])
    assert tokenizer.encode([{"role": "user", "content": "x"}]) == tokenizer.encode_text("user: x\nassistant:")
