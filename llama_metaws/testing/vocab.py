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
a character it has no token for in bytes), and special (control) tokens before the filler
words: ChatML's ``<|im_start|>`` and ``<|im_end|>`` (an end-of-turn token, as llama.cpp reads
that name); ``"chars-fim"`` also Qwen's fill-in-the-middle tokens (``<|fim_prefix|>``,
``<|fim_suffix|>``, ``<|fim_middle|>``, ``<|fim_pad|>``, ``<|repo_name|>``, ``<|file_sep|>``),
named in the GGUF's ``tokenizer.ggml.fim_*_token_id`` keys: a model ``/infill`` can serve. These
two add BOS to a prompt, as a llama model's SentencePiece vocabulary does (the others add
nothing). ``words``: also each word's prefixes as SentencePiece pieces (``▁w``, ``▁wo``, ...,
``▁word``, each scoring its length so the longest wins), so those words tokenize as one token each,
as a trained vocabulary tokenizes common words.

``"fim"``: ``"chars"`` (no BOS, no byte tokens but the newline) with the same FIM tokens and no
space put before a text, so that a piece of code tokenizes as it is, as a coder's BPE does: a
small model whose ``/infill`` prompts read back as their layout.
"""

from __future__ import annotations

from typing import List, Tuple

VOCABS = ("test", "chars", "chars-bytes", "chars-fim", "fim")

CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]
# FIM token -> its GGUF key (tokenizer.ggml.fim_KEY_token_id)
FIM_TOKENS = {"<|fim_prefix|>": "pre", "<|fim_suffix|>": "suf", "<|fim_middle|>": "mid",
              "<|fim_pad|>": "pad", "<|repo_name|>": "rep", "<|file_sep|>": "sep"}
#: the least ``n_vocab`` of ``chars-bytes`` and ``chars-fim``
MIN_FULL_VOCAB = 384

_JSON_PIECES = ['{"', '"}', '":', '",', '": "', "\u2581the", "true", "false", "null", "\u2581\u2581"]


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
    specials = {"chars": [], "fim": list(FIM_TOKENS), "chars-bytes": CHATML_TOKENS,
                "chars-fim": CHATML_TOKENS + list(FIM_TOKENS)}[kind]
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
        if kind == "fim":
            writer.add_add_space_prefix(False)  # a piece of code tokenizes as it is, as a coder's BPE does
    writer.add_add_bos_token(kind in ("chars-bytes", "chars-fim"))
    writer.add_add_eos_token(False)
    writer.add_eos_token_id(eos)  # so chat completions have an end-of-generation token
