"""A HF `tokenizers` tokenizer rebuilt from a GGUF file's `tokenizer.*` metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, merges, token types,
special ids and chat template as metadata and splits text with a regex chosen by
`tokenizer.ggml.pre`. We rebuild the same byte-level BPE tokenizer (model `gpt2`) and write
`tokenizer.json` + `tokenizer_config.json` (+ `generation_config.json`: the ids that end
generation), so both `tokenizers` alone and
`transformers.AutoTokenizer` load it from the converted folder. Other tokenizer models and
unknown pre-tokenizers are refused rather than guessed: a wrong split tokenizes silently wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_jax.formats.gguf_reader import gguf_metadata, open_gguf_reader
from dflash_jax.formats.hf_reader import ConversionError

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), applied in order, each isolating matches.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
PRE_TOKENIZER_SPLITS = {
    "gpt-2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    # Qwen2 / Qwen3: single digits, letters with one leading non-letter, newline runs
    "qwen2": (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    # Llama 3: the same with digits in runs of up to three
    "llama-bpe": (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
                  r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    # gpt-oss (o200k): a word is an optional capital run then lower-case letters (so "HelloWorld"
    # is two), contractions kept on it, digits in runs of up to three, "/" and newlines after punctuation
    "gpt-4o": (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
}
# Llama 3 matches a whole word found in the vocabulary before merging (`ignore_merges`, as
# llama.cpp and its own tokenizer.json do).
IGNORES_MERGES = {"llama-bpe"}
# Tokens that end a turn beside EOS (Llama 3's <|eot_id|> and <|eom_id|>): generation stops there.
END_OF_GENERATION_IDS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# llama.cpp token types (gguf.TokenType): control tokens are special, user-defined ones are
# plain added tokens; both are matched whole before the regex split.
CONTROL, USER_DEFINED = 3, 4
SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def gguf_tokenizer_files(path: str | Path) -> dict[str, str]:
    """{'tokenizer.json': ..., 'tokenizer_config.json': ..., 'generation_config.json': ...};
    {} when the file has no tokenizer."""
    metadata = gguf_metadata(open_gguf_reader(path))
    if "tokenizer.ggml.tokens" not in metadata:
        return {}
    tokenizer = tokenizer_from_gguf(metadata, Path(path).name)
    stop_ids = sorted({int(metadata[key]) for key in END_OF_GENERATION_IDS if key in metadata})
    return {
        "tokenizer.json": tokenizer.to_str(),
        "tokenizer_config.json": json.dumps(tokenizer_config(metadata), indent=2),
        "generation_config.json": json.dumps({"eos_token_id": stop_ids}, indent=2),
    }


def tokenizer_from_gguf(metadata: dict, file_name: str):
    """The byte-level BPE tokenizer the metadata describes, special tokens and BOS/EOS included."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ConversionError(
            f"{file_name} has a {model!r} tokenizer; only byte-level BPE ('gpt2') tokenizers are supported."
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ConversionError(
            f"{file_name} uses pre-tokenizer {pre!r}; supported: {', '.join(PRE_TOKENIZER_SPLITS)}."
        )
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges,
                                     ignore_merges=pre in IGNORES_MERGES))
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in PRE_TOKENIZER_SPLITS[pre]]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind == CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, types) if kind == USER_DEFINED]
    )
    tokenizer.post_processor = _bos_eos_template(metadata, tokens, processors)
    return tokenizer


def _bos_eos_template(metadata: dict, tokens: list[str], processors):
    """Prepend BOS / append EOS to every encoding when the file's add_bos/add_eos flags say so."""
    wrap = {}
    for kind in ("bos", "eos"):
        token_id = metadata.get(f"tokenizer.ggml.{kind}_token_id")
        if metadata.get(f"tokenizer.ggml.add_{kind}_token", False) and token_id is not None:
            wrap[kind] = (tokens[token_id], token_id)
    bos = [wrap["bos"][0]] if "bos" in wrap else []
    eos = [wrap["eos"][0]] if "eos" in wrap else []
    return processors.TemplateProcessing(
        single=[*bos, "$A", *eos],
        pair=[*bos, "$A", *eos, *bos, "$B:1", *eos],
        special_tokens=sorted(set(wrap.values())),
    )


def tokenizer_config(metadata: dict) -> dict:
    """tokenizer_config.json: special tokens, chat template, context length.

    BOS/EOS insertion lives in tokenizer.json's post-processor only, so no add_*_token flags.
    """
    tokens = metadata["tokenizer.ggml.tokens"]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # tokenizer.json as written, no per-model rebuild
        "clean_up_tokenization_spaces": False,
    }
    for name, key in SPECIAL_TOKEN_IDS.items():
        if key in metadata:
            config[name] = tokens[metadata[key]]
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    if "llama.context_length" in metadata:
        config["model_max_length"] = int(metadata["llama.context_length"])
    return config
