"""A model's tokenizer and chat template, for turning prompts into token ids and answers back.

Text needs the model folder's `tokenizer.json` (HF `tokenizers`) and, for chat, its chat
template (`tokenizer_config.json` or `chat_template.jinja`, rendered with jinja2). A llama.cpp
`.gguf` file carries both as metadata; they are rebuilt from it as the converter does.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from dflash_jax.formats.gguf_tokenizer import gguf_tokenizer_files

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


class NoTokenizerError(ValueError):
    """The model has no tokenizer.json (nor GGUF tokenizer metadata): only token ids work."""


class ChatTokenizer:
    """The target's tokenizer.json plus its chat template (plain text when there is none)."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        files = _tokenizer_files(model_dir)
        if "tokenizer.json" not in files:
            raise NoTokenizerError(f"{model_dir} has no tokenizer.json; give token-id prompts instead of text.")
        self.tokenizer = Tokenizer.from_str(files["tokenizer.json"])
        config = json.loads(files.get("tokenizer_config.json", "{}"))
        self.template = files.get("chat_template.jinja", config.get("chat_template"))
        self.special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
        self.stop_token_ids = self._stop_ids(json.loads(files.get("generation_config.json", "{}")))

    def encode(self, messages: list[dict[str, str]], template_kwargs: dict | None = None) -> list[int]:
        """Messages through the chat template; `template_kwargs` are more template variables
        (a server's `chat_template_kwargs`, such as enable_thinking; add_generation_prompt
        too, True unless given)."""
        if self.template is None:
            return self.encode_text("\n\n".join(m["content"] for m in messages))
        return self.tokenizer.encode(self._render(messages, template_kwargs), add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Plain text, no chat template; BOS/EOS as the tokenizer's post-processor adds them."""
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        """Generated ids as text, stop and other special tokens left out."""
        stops = set(self.stop_token_ids)
        return self.tokenizer.decode([t for t in token_ids if t not in stops], skip_special_tokens=True)

    def _render(self, messages, template_kwargs=None) -> str:
        if "messages" in (template_kwargs or {}):
            raise ValueError("chat_template_kwargs may not set 'messages'; send them as the request's messages.")
        specials = {k: v or "" for k, v in self.special.items()}
        variables = {"add_generation_prompt": True, **specials, **(template_kwargs or {})}
        return self._compiled_template.render(messages=messages, **variables)

    @functools.cached_property
    def _compiled_template(self):
        """The chat template compiled once: compiling it costs each request more than rendering."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"the chat template refused the prompt: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.template)

    def _stop_ids(self, generation_config: dict) -> list[int]:
        """eos from tokenizer_config.json and generation_config.json (int or list)."""
        ids = set()
        if self.special["eos_token"] and self.tokenizer.token_to_id(self.special["eos_token"]) is not None:
            ids.add(self.tokenizer.token_to_id(self.special["eos_token"]))
        eos = generation_config.get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return sorted(ids)


def load_tokenizer(model_path: str | Path) -> ChatTokenizer | None:
    """The model's tokenizer, or None when it has none (token-id prompts still work)."""
    try:
        return ChatTokenizer(model_path)
    except NoTokenizerError:
        return None


def _tokenizer_files(model_path: Path) -> dict[str, str]:
    """File name -> text of the tokenizer files in a model folder, or rebuilt from a .gguf file."""
    if model_path.suffix.lower() == ".gguf" and model_path.is_file():
        return gguf_tokenizer_files(model_path)
    return {name: (model_path / name).read_text() for name in TOKENIZER_FILES if (model_path / name).is_file()}


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as strings or {"content": ...} dicts."""
    return value.get("content") if isinstance(value, dict) else value
