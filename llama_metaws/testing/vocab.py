"""The tiny models' tokenizers: llama.cpp's TEST vocabulary, or a vocabulary of characters.

``"test"`` (the default): ``tokenizer.ggml.model = "test"``, whose every token prints as its id
in hex (``"0"`` .. ``"7f"``). Nothing but hex digits can ever be generated, so a grammar that
needs any other character (JSON's ``{``) has no token to continue with.

``"chars"``: a SentencePiece (``llama``) vocabulary whose tokens are ``<unk>``, ``<s>``
(BOS, not added), the 95 printable ASCII characters (space as SentencePiece's ``▁``), a newline
byte token, a few JSON pieces and filler words, and ``</s>`` last (the end-of-generation token,
as in every tiny model). Any printable text tokenizes and any JSON can be generated: for tests
of grammars, ``response_format`` and tool calls.

``"chat-qwen"``, ``"chat-llama3"``, ``"chat-deepseek"``: ``chars`` holding a chat family's special
tokens (:data:`CHAT_FAMILIES`), for tests of llama.cpp's chat layer on real templates.
"""

from __future__ import annotations

from typing import List, Tuple

#: a chat model family's special tokens, as its real vocabulary types them: control tokens
#: (rendered only as special text) and user-defined ones (always text); a ``chat-<family>``
#: vocabulary is ``chars`` with these in place of the first filler words, so chat prompts are
#: short and llama.cpp's chat layer sees its markers as single tokens
CHAT_FAMILIES = {
    "qwen": {"control": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
             "user": ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]},
    "llama3": {"control": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                           "<|eom_id|>", "<|python_tag|>"], "user": []},
    "deepseek": {"control": ["<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
                             "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"],
                 "user": ["<think>", "</think>", "<\uff5ctool\u2581calls\u2581begin\uff5c>",
                          "<\uff5ctool\u2581calls\u2581end\uff5c>", "<\uff5ctool\u2581call\u2581begin\uff5c>",
                          "<\uff5ctool\u2581call\u2581end\uff5c>", "<\uff5ctool\u2581sep\uff5c>"]},
}

VOCABS = ("test", "chars") + tuple(f"chat-{f}" for f in CHAT_FAMILIES)

_JSON_PIECES = ['{"', '"}', '":', '",', '": "', "\u2581the", "true", "false", "null", "\u2581\u2581"]


def chat_vocab(family: str, n_vocab: int) -> Tuple[List[str], List[float], List[int]]:
    """``chars`` with a chat family's special tokens (:data:`CHAT_FAMILIES`) in its filler slots."""
    import gguf

    texts, scores, types = chars_vocab(n_vocab)
    spec = CHAT_FAMILIES[family]
    specials = [(t, gguf.TokenType.CONTROL) for t in spec["control"]] + \
               [(t, gguf.TokenType.USER_DEFINED) for t in spec["user"]]
    first = texts.index("\u2581w0")
    if first + len(specials) >= n_vocab - 1:
        raise ValueError(f"a chat-{family} vocabulary needs more than {n_vocab} tokens")
    for i, (text, kind) in enumerate(specials):
        texts[first + i], types[first + i], scores[first + i] = text, int(kind), 0.0
    return texts, scores, types


def chars_vocab(n_vocab: int) -> Tuple[List[str], List[float], List[int]]:
    """Texts, scores and token types (gguf's TokenType values) of the ``chars`` vocabulary."""
    import gguf

    printable = ["\u2581" if c == " " else c for c in map(chr, range(32, 127))]
    texts = ["<unk>", "<s>"] + printable + ["<0x0A>"] + _JSON_PIECES
    n_fill = n_vocab - 1 - len(texts)
    if n_fill < 0:
        raise ValueError(f"a chars vocabulary needs at least {len(texts) + 1} tokens, got {n_vocab}")
    texts += [f"\u2581w{i}" for i in range(n_fill)] + ["</s>"]
    T = gguf.TokenType
    types = ([T.UNKNOWN, T.CONTROL] + [T.NORMAL] * len(printable) + [T.BYTE]
             + [T.NORMAL] * (len(_JSON_PIECES) + n_fill) + [T.CONTROL])
    # single characters score below longer pieces, so SentencePiece merges into the pieces
    scores = [0.0, 0.0] + [-1.0] * (len(printable) + 1) + [0.0] * (len(_JSON_PIECES) + n_fill + 1)
    return texts, scores, [int(t) for t in types]


def write_vocab(writer, kind: str, n_vocab: int, eos: int) -> None:
    """Add the tokenizer ``kind`` to a GGUFWriter (no BOS or EOS added to prompts)."""
    import gguf

    if kind not in VOCABS:
        raise ValueError(f"unknown vocab {kind!r}; supported: {', '.join(VOCABS)}")
    if kind == "test":
        writer.add_tokenizer_model("test")
        writer.add_token_list([format(i, "x") for i in range(n_vocab)])
        writer.add_token_scores([0.0] * n_vocab)
        writer.add_token_types([int(gguf.TokenType.NORMAL)] * n_vocab)
    else:
        texts, scores, types = chars_vocab(n_vocab) if kind == "chars" else chat_vocab(kind[5:], n_vocab)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(texts)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_unk_token_id(0)
        if kind != "chars":  # as the chat families' BPE vocabularies: no space before a text
            writer.add_add_space_prefix(False)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_eos_token_id(eos)  # so chat completions have an end-of-generation token
