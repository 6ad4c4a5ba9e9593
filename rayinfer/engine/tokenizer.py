"""Text <-> token ids for one checkpoint, and its chat template.

`Tokenizer.from_pretrained(folder)` reads what transformers reads: `tokenizer.json` (through the
`tokenizers` library), `tokenizer_config.json` (special tokens as strings or {"content": ...},
added tokens, the chat template as a string or a list of named templates),
`chat_template.jinja` / `additional_chat_templates/*.jinja`, and the eos ids of `config.json` and
`generation_config.json`. Ids and rendered chat text equal transformers' `PreTrainedTokenizerFast`.
As in transformers 5, tokenizer.json's post-processor alone decides whether a bos token is added:
`add_bos_token` / `add_eos_token` in tokenizer_config.json are ignored when tokenizer.json exists.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from rayinfer.engine.chat_template import render_chat

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Texts this long encode through `encode_batch`, which releases the GIL while it works (`encode`
# holds it: a 200,000-word prompt stopped every other thread of the process for 0.45 s).
GIL_FREE_ENCODE_CHARS = 4096


class TokenizerError(ValueError):
    """A checkpoint's tokenizer cannot do what was asked; the message says what to do."""


class NoTokenizerError(FileNotFoundError):
    """The checkpoint folder has no tokenizer.json: the model takes token ids only."""


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat templates of its checkpoint."""

    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: dict[str, str],
        eos_token_ids: Iterable[int] = (),
        chat_templates: dict[str, str] | None = None,
        name: str = "model",
    ):
        self.backend = backend
        self.special_tokens = special_tokens  # bos_token, eos_token, ... -> token text
        self.chat_templates = chat_templates or {}  # template name -> jinja source
        self.name = name
        eos_token = special_tokens.get("eos_token")
        eos_ids = set(eos_token_ids)
        if eos_token is not None and backend.token_to_id(eos_token) is not None:
            eos_ids.add(backend.token_to_id(eos_token))
        self.eos_token_ids: set[int] = eos_ids
        bos_token = special_tokens.get("bos_token")
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.all_special_ids: set[int] = {
            token_id
            for token_id, added in backend.get_added_tokens_decoder().items()
            if added.special
        }

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise NoTokenizerError(
                f"model {str(path)!r} has no tokenizer.json; pass token ids or set tokenizer=..."
            )
        config = _read_json(folder / "tokenizer_config.json")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        special_tokens = _special_tokens(config)
        _add_missing_tokens(backend, config, special_tokens)
        return cls(
            backend,
            special_tokens,
            eos_token_ids=_checkpoint_eos_ids(folder),
            chat_templates=_chat_templates(folder, config),
            name=str(path),
        )

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) >= GIL_FREE_ENCODE_CHARS:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_last(self, text: str, max_tokens: int) -> list[int]:
        """At most max_tokens ids: the special tokens `encode` adds (BOS) around the text's last
        tokens, as transformers' `truncation=True, max_length=max_tokens` with
        `truncation_side="left"` (vLLM's truncate_prompt_tokens on a text)."""
        if len(text) >= GIL_FREE_ENCODE_CHARS:
            encoding = self.backend.encode_batch([text], add_special_tokens=False)[0]
        else:
            encoding = self.backend.encode(text, add_special_tokens=False)
        processor = self.backend.post_processor
        num_special = processor.num_special_tokens_to_add(False) if processor is not None else 0
        encoding.truncate(max(max_tokens - num_special, 0), direction="left")
        return self.backend.post_process(encoding).ids

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: its vocabulary string's length
        (a byte-level token's string has one character per byte, at least one per text char)."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """The ids' vocabulary strings (a byte-level BPE's "Ġworld"), as transformers'
        `convert_ids_to_tokens`; every id must be in the vocabulary."""
        return [self.backend.id_to_token(token_id) for token_id in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # transformers 5 ignores clean_up_tokenization_spaces for BPE models, and so does rayinfer.
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **template_kwargs,
    ) -> str:
        """The conversation rendered as text, exactly as transformers' `apply_chat_template`
        (engine/chat_template.py). template_kwargs: more variables for the template (Qwen3's
        `enable_thinking`), over the special tokens and `documents`.

        The text already holds the template's special tokens: encode it with
        `add_special_tokens=False` (or call `encode_chat`).
        """
        template = self._select_template(chat_template, tools)
        variables = {"tools": tools, "documents": None}
        variables.update((k, v) for k, v in self.special_tokens.items() if v is not None)
        variables.update(template_kwargs)
        return render_chat(
            template, messages, variables, add_generation_prompt, continue_final_message
        )

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        *,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The rendered conversation's ids. add_special_tokens: the tokenizer's own (a bos)
        on top of what the template writes, as vLLM's chat field of that name."""
        text = self.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
        return self.encode(text, add_special_tokens=add_special_tokens)

    def template_reads_tools(self) -> bool:
        """Whether the chat template that renders tools names them at all."""
        return "tools" in self._select_template(None, [])

    def _select_template(self, chat_template: str | None, tools: list[dict] | None) -> str:
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if not self.chat_templates:
            raise TokenizerError(
                f"model {self.name!r} has no chat template (no chat_template in "
                "tokenizer_config.json and no chat_template.jinja); send a plain prompt to "
                "/v1/completions or pass chat_template=..."
            )
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        raise TokenizerError(
            f"model {self.name!r} has several chat templates and none named 'default'; "
            f"pass chat_template= one of {sorted(self.chat_templates)}"
        )


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _special_tokens(config: dict) -> dict[str, str]:
    tokens = {key: _token_text(config.get(key)) for key in SPECIAL_TOKEN_KEYS}
    return {key: text for key, text in tokens.items() if text is not None}


def _add_missing_tokens(backend: BackendTokenizer, config: dict, special_tokens: dict) -> None:
    """Register added and special tokens that tokenizer.json lacks, as transformers does."""
    added = [
        AddedToken(
            entry["content"],
            single_word=entry.get("single_word", False),
            lstrip=entry.get("lstrip", False),
            rstrip=entry.get("rstrip", False),
            normalized=entry.get("normalized", False),
            special=entry.get("special", True),
        )
        for _, entry in sorted(config.get("added_tokens_decoder", {}).items(), key=_by_id)
    ]
    added += [AddedToken(text, special=True, normalized=False) for text in special_tokens.values()]
    missing = [token for token in added if backend.token_to_id(token.content) is None]
    if missing:
        backend.add_tokens(missing)


def _by_id(item: tuple[str, dict]) -> int:
    return int(item[0])


def _checkpoint_eos_ids(folder: Path) -> set[int]:
    """eos_token_id of config.json and generation_config.json: an int, a list, or absent."""
    eos_ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        value = _read_json(folder / name).get("eos_token_id")
        if isinstance(value, int):
            eos_ids.add(value)
        elif isinstance(value, list):
            eos_ids.update(value)
    return eos_ids


def _chat_templates(folder: Path, config: dict) -> dict[str, str]:
    """Template name -> source; template files win over tokenizer_config.json, as in HF."""
    templates = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for path in sorted((folder / "additional_chat_templates").glob("*.jinja")):
        templates[path.stem] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    legacy = _read_json(folder / "chat_template.json").get("chat_template")
    template = config.get("chat_template") or legacy
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template}
    return {"default": template} if template else {}
