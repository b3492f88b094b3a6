"""The tiny models' tokenizers: llama.cpp's TEST vocabulary, or a vocabulary of characters.

``"test"`` (the default): ``tokenizer.ggml.model = "test"``, whose every token prints as its id
in hex (``"0"`` .. ``"7f"``). Nothing but hex digits can ever be generated, so a grammar that
needs any other character (JSON's ``{``) has no token to continue with.

``"chars"``: a SentencePiece (``llama``) vocabulary whose tokens are ``<unk>``, ``<s>``
(BOS, not added), the 95 printable ASCII characters (space as SentencePiece's ``▁``), a newline
byte token, a few JSON pieces and filler words, and ``</s>`` last (the end-of-generation token,
as in every tiny model). Any printable text tokenizes and any JSON can be generated: for tests
of grammars, ``response_format`` and tool calls.

``"fim"``: ``"chars"`` with Qwen2.5-Coder's six fill-in-the-middle tokens (:data:`FIM_TOKENS`,
control tokens named in the ``tokenizer.ggml.fim_*_token_id`` keys, as a real coder's GGUF has
them) in place of its last filler words, and no space put before a text: for ``/infill``.
"""

from __future__ import annotations

from typing import List, Tuple

VOCABS = ("test", "chars", "fim")

#: the ``fim`` vocabulary's FIM tokens, by the gguf key each is named in (Qwen2.5-Coder's texts)
FIM_TOKENS = {"FIM_PRE_ID": "<|fim_prefix|>", "FIM_SUF_ID": "<|fim_suffix|>", "FIM_MID_ID": "<|fim_middle|>",
              "FIM_PAD_ID": "<|fim_pad|>", "FIM_REP_ID": "<|repo_name|>", "FIM_SEP_ID": "<|file_sep|>"}

_JSON_PIECES = ['{"', '"}', '":', '",', '": "', "\u2581the", "true", "false", "null", "\u2581\u2581"]


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
        texts, scores, types = chars_vocab(n_vocab)
        if kind == "fim":
            first = n_vocab - 1 - len(FIM_TOKENS)  # the last filler words, before the end token
            for i, (key, text) in enumerate(FIM_TOKENS.items()):
                texts[first + i], types[first + i] = text, int(gguf.TokenType.CONTROL)
                writer.add_uint32(getattr(gguf.Keys.Tokenizer, key), first + i)
            writer.add_add_space_prefix(False)  # a piece of code tokenizes as it is, as a coder's BPE does
        writer.add_tokenizer_model("llama")
        writer.add_token_list(texts)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_eos_token_id(eos)  # so chat completions have an end-of-generation token
