"""The small policy's tokenizer: byte-level BPE without merges, the answer tags, and a ChatML chat template.
Used as a library by the policy build: `build_tokenizer()`.

One token per byte (ASCII text is one token per character), so any text encodes and
decode(encode(s)) == s for NFC-normalized text; `<answer>` and `</answer>` are single tokens;
`<|im_start|>` and `<|im_end|>` are ChatML's turn markers, as special tokens, with the chat
template Qwen2.5-Instruct uses (without its default system turn).
"""

from __future__ import annotations

from nano_miles.tasks.arithmetic import CLOSE_TAG, OPEN_TAG

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"  # UNK is never produced: every byte has a token
ANSWER_TAGS = (OPEN_TAG, CLOSE_TAG)  # one token each; the reward looks for these exact tags
SPECIALS = [PAD, EOS, UNK, *ANSWER_TAGS]
IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # special, after the bytes: byte ids stay 5 + byte
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")
MAX_POSITIONS = 256
# The same normalizer, pre-tokenizer and decoder as Qwen2Tokenizer, which transformers 5 substitutes
# for whatever tokenizer.json says when config.json is a qwen2 model; so both load paths agree.
QWEN2_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                     r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def byte_symbols() -> list[str]:
    """The printable stand-in character of each byte 0..255 used by byte-level BPE (GPT-2's table):
    printable Latin-1 bytes stand for themselves, the others are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, num_shifted = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + num_shifted)
            num_shifted += 1
    return [symbols[b] for b in range(256)]


# Token id of byte b is len(SPECIALS) + b; the ChatML markers come last.
VOCAB = [*SPECIALS, *byte_symbols(), IM_START, IM_END]


def build_tokenizer():
    """A byte-level BPE without merges (one token per byte; ASCII text is one token per character)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(VOCAB)}, merges=[]))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD, EOS, UNK)])
    # Not special: skip_special_tokens=True must keep the tags, the reward reads them.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ANSWER_TAGS])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (IM_START, IM_END)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                                   clean_up_tokenization_spaces=False, model_max_length=MAX_POSITIONS)
    fast.chat_template = CHAT_TEMPLATE
    return fast
