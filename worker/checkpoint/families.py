"""Tokenizer families of the checkpoint presets: special tokens, pre-tokenizers, chat templates.

Chat templates are jinja, rendered with HF's conventions (trim_blocks, lstrip_blocks,
``raise_exception``, ``bos_token``/``eos_token`` variables).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["CHAT_TEMPLATES", "TOKENIZER_FAMILIES", "TokenizerFamily"]

# ----------------------------------------------------------------------------------------------
# Chat templates (jinja, rendered with HF's conventions: trim_blocks, lstrip_blocks, raise_exception,
# bos_token/eos_token variables).
# ----------------------------------------------------------------------------------------------

_LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

_LLAMA2_TEMPLATE = r"""{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system_message = '<<SYS>>\n' + messages[0]['content'] | trim + '\n<</SYS>>\n\n' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first %}
            {%- set content = system_message + message['content'] | trim %}
        {%- else %}
            {%- set content = message['content'] | trim %}
        {%- endif %}
        {{- bos_token + '[INST] ' + content + ' [/INST]' }}
    {%- else %}
        {{- ' ' + message['content'] | trim + ' ' + eos_token }}
    {%- endif %}
{%- endfor %}
"""

_ZEPHYR_TEMPLATE = r"""{%- for message in messages %}
    {{- '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\n' }}
{%- endif %}
"""

_MISTRAL_TEMPLATE = r"""{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system_prefix = messages[0]['content'] + '\n\n' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_prefix = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {{- '[INST] ' + (system_prefix if loop.first else '') + message['content'] + ' [/INST]' }}
    {%- else %}
        {{- message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""

_CHATML_QWEN2_TEMPLATE = r"""{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

_CHATML_QWEN3_TEMPLATE = r"""{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

CHAT_TEMPLATES: Mapping[str, str] = MappingProxyType(
    {
        "llama3": _LLAMA3_TEMPLATE,
        "llama2": _LLAMA2_TEMPLATE,
        "zephyr": _ZEPHYR_TEMPLATE,
        "mistral": _MISTRAL_TEMPLATE,
        "chatml-qwen2": _CHATML_QWEN2_TEMPLATE,
        "chatml-qwen3": _CHATML_QWEN3_TEMPLATE,
    }
)

# Split pattern used by Llama-3 (digits grouped up to 3) and Qwen2 (single digits).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class TokenizerFamily:
    """Tokenizer conventions of a model family.

    ``split_pattern`` is the pre-tokenizer regex (None: GPT-2 byte-level default split).
    ``special_tokens`` lists the family's control tokens (marked special; skipped on decode),
    ``added_tokens`` extra non-special added tokens (kept on decode, e.g. Qwen3's ``<think>``).
    ``nfc_normalize`` applies Unicode NFC before tokenizing (as Qwen's tokenizer does; HF
    transformers hard-codes it for Qwen2), so only NFC text round-trips exactly.
    The role attributes (``bos_token`` ...) name tokens from ``special_tokens``.
    """

    name: str
    split_pattern: str | None
    special_tokens: tuple[str, ...]
    bos_token: str | None
    eos_token: str
    add_bos_token: bool
    chat_template: str
    unk_token: str | None = None
    pad_token: str | None = None
    added_tokens: tuple[str, ...] = ()
    nfc_normalize: bool = False

    @property
    def all_tokens(self) -> tuple[str, ...]:
        """Special tokens followed by non-special added tokens."""
        return self.special_tokens + self.added_tokens


TOKENIZER_FAMILIES: Mapping[str, TokenizerFamily] = MappingProxyType(
    {
        f.name: f
        for f in (
            TokenizerFamily(
                name="llama3",
                split_pattern=_LLAMA3_SPLIT,
                special_tokens=(
                    "<|begin_of_text|>",
                    "<|end_of_text|>",
                    "<|start_header_id|>",
                    "<|end_header_id|>",
                    "<|eot_id|>",
                    "<|finetune_right_pad_id|>",
                ),
                bos_token="<|begin_of_text|>",
                eos_token="<|end_of_text|>",
                add_bos_token=True,
                chat_template="llama3",
            ),
            TokenizerFamily(
                name="llama2",
                split_pattern=None,
                special_tokens=("<unk>", "<s>", "</s>"),
                bos_token="<s>",
                eos_token="</s>",
                unk_token="<unk>",
                add_bos_token=True,
                chat_template="llama2",
            ),
            TokenizerFamily(
                name="tinyllama",
                split_pattern=None,
                special_tokens=("<unk>", "<s>", "</s>"),
                bos_token="<s>",
                eos_token="</s>",
                unk_token="<unk>",
                add_bos_token=True,
                chat_template="zephyr",
            ),
            TokenizerFamily(
                name="mistral",
                split_pattern=None,
                special_tokens=("<unk>", "<s>", "</s>"),
                bos_token="<s>",
                eos_token="</s>",
                unk_token="<unk>",
                add_bos_token=True,
                chat_template="mistral",
            ),
            TokenizerFamily(
                name="qwen2",
                split_pattern=_QWEN_SPLIT,
                special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                bos_token=None,
                eos_token="<|endoftext|>",
                pad_token="<|endoftext|>",
                add_bos_token=False,
                chat_template="chatml-qwen2",
                nfc_normalize=True,
            ),
            TokenizerFamily(
                name="qwen3",
                split_pattern=_QWEN_SPLIT,
                special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                added_tokens=("<think>", "</think>"),
                bos_token=None,
                eos_token="<|endoftext|>",
                pad_token="<|endoftext|>",
                add_bos_token=False,
                chat_template="chatml-qwen3",
                nfc_normalize=True,
            ),
        )
    }
)
