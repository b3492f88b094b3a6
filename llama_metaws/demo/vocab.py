"""The tiny models' tokenizers: llama.cpp's TEST vocabulary, or a vocabulary of characters.

``"test"`` (the default): ``tokenizer.ggml.model = "test"``, whose every token prints as its id
in hex (``"0"`` .. ``"7f"``). Nothing but hex digits can ever be generated, so a grammar that
needs any other character (JSON's ``{``) has no token to continue with.

``"chars"``: a SentencePiece (``llama``) vocabulary whose tokens are ``<unk>``, ``<s>``
(BOS, not added), the 95 printable ASCII characters (space as SentencePiece's ``▁``), a newline
byte token, a few JSON pieces and filler words, and ``</s>`` last (the end-of-generation token,
as in every tiny model). Any printable text tokenizes and any JSON can be generated: for tests
of grammars, ``response_format`` and tool calls.

``"chars-bytes"`` and ``"chars-fim"`` (at least :data:`MIN_FULL_VOCAB` tokens): ``chars`` plus
the 256 byte tokens ``<0x00>`` .. ``<0xFF>``, so any UTF-8 text tokenizes (SentencePiece spells
a character it has no token for in bytes), as the llama2.c vocabularies of llama.cpp's test
models do. Neither has ChatML's markers as special tokens (those models have none, and read
llama.cpp's ChatML fallback as text: a special token would put SentencePiece's space before the
text after it, ``<|im_start|>▁assistant``, which is not the generation prompt the chat layer's
grammars begin with); ``"chars-fim"`` has Qwen's fill-in-the-middle tokens (``<|fim_prefix|>``,
``<|fim_suffix|>``, ``<|fim_middle|>``, ``<|fim_pad|>``, ``<|repo_name|>``, ``<|file_sep|>``)
as control tokens, named in the GGUF's ``tokenizer.ggml.fim_*_token_id`` keys: a model ``/infill`` can serve. These
two add BOS to a prompt, as a llama model's SentencePiece vocabulary does (the others add
nothing). ``words``: also each word's prefixes as SentencePiece pieces (``▁w``, ``▁wo``, ...,
``▁word``, each scoring its length so the longest wins), so those words tokenize as one token each,
as a trained vocabulary tokenizes common words.

``"fim"``: ``"chars"`` (no BOS, no byte tokens but the newline) with the same FIM tokens and no
space put before a text, so that a piece of code tokenizes as it is, as a coder's BPE does: a
small model whose ``/infill`` prompts read back as their layout.

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


VOCABS = ("test", "chars", "chars-bytes", "chars-fim", "fim") + tuple(f"chat-{f}" for f in CHAT_FAMILIES)

# FIM token -> its GGUF key (tokenizer.ggml.fim_KEY_token_id)
FIM_TOKENS = {"<|fim_prefix|>": "pre", "<|fim_suffix|>": "suf", "<|fim_middle|>": "mid",
              "<|fim_pad|>": "pad", "<|repo_name|>": "rep", "<|file_sep|>": "sep"}
#: the least ``n_vocab`` of ``chars-bytes`` and ``chars-fim``
MIN_FULL_VOCAB = 384

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



def word_pieces(words) -> List[str]:
    """The pieces that make each of ``words`` one token: its ``▁``-prefixed prefixes."""
    out = set()
    for w in words:
        for i in range(1, len(w) + 1):
            out.add("\u2581" + w[:i])
    return sorted(out)


def chars_vocab(n_vocab: int, kind: str = "chars", words=()) -> Tuple[List[str], List[float], List[int]]:
    """Texts, scores and token types (gguf's TokenType values) of a ``chars`` vocabulary."""
    import gguf

    T = gguf.TokenType
    printable = ["\u2581" if c == " " else c for c in map(chr, range(32, 127))]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)] if kind in ("chars-bytes", "chars-fim") else ["<0x0A>"]
    specials = {"chars": [], "fim": list(FIM_TOKENS), "chars-bytes": [], "chars-fim": list(FIM_TOKENS)}[kind]
    # single characters score below longer pieces, so SentencePiece merges into the pieces
    rows = ([("<unk>", 0.0, T.UNKNOWN), ("<s>", 0.0, T.CONTROL)]
            + [(c, -1.0, T.NORMAL) for c in printable] + [(b, -1.0, T.BYTE) for b in byte_tokens]
            + [(p, 0.0, T.NORMAL) for p in _JSON_PIECES] + [(x, 0.0, T.CONTROL) for x in specials])
    known = {r[0] for r in rows}
    rows += [(p, float(len(p)), T.NORMAL) for p in word_pieces(words) if p not in known]
    n_fill = n_vocab - 1 - len(rows)
    if n_fill < 0:
        raise ValueError(f"a {kind} vocabulary needs at least {len(rows) + 1} tokens, got {n_vocab}")
    rows += [(f"\u2581w{i}", 0.0, T.NORMAL) for i in range(n_fill)] + [("</s>", 0.0, T.CONTROL)]
    return [r[0] for r in rows], [r[1] for r in rows], [int(r[2]) for r in rows]


def write_vocab(writer, kind: str, n_vocab: int, eos: int, words=()) -> None:
    """Add the tokenizer ``kind`` to a GGUFWriter (no EOS added to prompts; BOS as the module
    docstring says)."""
    import gguf

    if kind not in VOCABS:
        raise ValueError(f"unknown vocab {kind!r}; supported: {', '.join(VOCABS)}")
    if kind == "test":
        writer.add_tokenizer_model("test")
        writer.add_token_list([format(i, "x") for i in range(n_vocab)])
        writer.add_token_scores([0.0] * n_vocab)
        writer.add_token_types([int(gguf.TokenType.NORMAL)] * n_vocab)
    else:
        if kind.startswith("chat-"):
            texts, scores, types = chat_vocab(kind[len("chat-"):], n_vocab)
        else:
            texts, scores, types = chars_vocab(n_vocab, kind, words)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(texts)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_unk_token_id(0)
        if kind in ("chars-fim", "fim"):
            for text, key in FIM_TOKENS.items():
                writer.add_uint32(f"tokenizer.ggml.fim_{key}_token_id", texts.index(text))
        if kind == "fim" or kind.startswith("chat-"):  # as a coder's or a chat family's BPE: no space before a text
            writer.add_add_space_prefix(False)
    writer.add_add_bos_token(kind in ("chars-bytes", "chars-fim"))
    writer.add_add_eos_token(False)
    writer.add_eos_token_id(eos)  # so chat completions have an end-of-generation token
