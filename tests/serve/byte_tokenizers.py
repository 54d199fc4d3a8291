"""Two small Hugging Face tokenizers whose tokens can hold part of a character, built offline in
a second with ``tokenizers``, and a tiny random Llama that uses one of them.

* ``sentencepiece_byte_fallback``: SentencePiece's layout (Gemma's and Llama's): ``▁`` for a
  space, whole-character pieces for ASCII letters and a few CJK characters, and a byte-fallback
  piece ``<0xNN>`` for every byte, which is how any other character (an emoji) is written. BOS is
  added to every encoded text.
* ``byte_level_bpe``: GPT-2's byte-level BPE (SmolLM2's, Qwen's): one piece per byte and merges
  that join bytes into pieces ending inside a character (``F0 9F`` of an emoji, ``E4 B8`` of a
  CJK character).
"""

from __future__ import annotations

from pathlib import Path

#: characters with a piece of their own in the byte-fallback vocabulary (any other is bytes)
WHOLE_CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'中文字"
#: words with a piece of their own (after ``▁``), each built from the characters above by merges
WORDS = ("▁the", "▁cat", "▁sat", "▁on", "▁mat", "中文")
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def sentencepiece_byte_fallback() -> object:
    """A ``PreTrainedTokenizerFast``: ids 0-2 ``<unk> <s> </s>``, 3-258 ``<0x00>``-``<0xFF>``,
    then ``▁``, the whole characters and the merged words."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {UNK: 0, BOS: 1, EOS: 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in ["▁", *WHOLE_CHARACTERS]:
        vocab.setdefault(piece, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        for end in range(2, len(word) + 1):
            left, right = word[: end - 1], word[end - 1]
            if word[:end] not in vocab:
                merges.append((left, right))
                vocab[word[:end]] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=UNK,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def byte_level_bpe() -> object:
    """A ``PreTrainedTokenizerFast``: GPT-2's 256-character alphabet (``tokenizers``' own), then
    merges of a space with an emoji's first byte and then its second (a piece ``" \\xf0\\x9f"``),
    of the emoji's first two bytes, and of a CJK character's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    to_alphabet = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def chars(text: str) -> str:  # the alphabet's characters for the UTF-8 bytes of ``text``
        return "".join(piece for piece, _ in to_alphabet.pre_tokenize_str(text))

    emoji, cjk, space = chars("😀"), chars("中"), chars(" ")
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [(space, emoji[0]), (space + emoji[0], emoji[1]), (emoji[0], emoji[1]), (cjk[0], cjk[1])]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = to_alphabet
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False)


def byte_fallback_llama(directory: Path) -> Path:
    """A tiny random Llama (``tiny-llama``'s sizes, seed 0) whose vocabulary is
    ``sentencepiece_byte_fallback``'s, with that tokenizer saved beside it; built once."""
    from engine.model.checkpoints.tiny import build_tiny_checkpoint

    if (directory / "tokenizer.json").is_file():
        return directory
    tokenizer = sentencepiece_byte_fallback()
    vocab_size = len(tokenizer)  # type: ignore[arg-type]
    build_tiny_checkpoint("tiny-llama", directory, seed=0, vocab_size=vocab_size)
    tokenizer.save_pretrained(str(directory))  # type: ignore[attr-defined]
    return directory
