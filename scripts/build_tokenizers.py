"""Build the zoo's tokenizers (models/tokenizers/vocab-<N>/), one per vocabulary size the configs use.

The zoo's models have random weights and no tokenizer to download, so these are made, not
trained: byte-level BPE (GPT-2's byte alphabet, lossless for any UTF-8 text) whose vocabulary is
exactly the model's — ids 0/1/2 are <pad>/<s>/</s> as in every zoo config, then the 243 bytes
valid UTF-8 can contain, then merges of frequent English letter pairs and triples, in a fixed
order, until the vocabulary is full — with a chat template. Re-run after adding a vocabulary size:

    python scripts/build_tokenizers.py
"""

import itertools
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
SPECIAL = ["<pad>", "<s>", "</s>"]
NEVER_IN_UTF8 = {0xC0, 0xC1, *range(0xF5, 0x100)}
# Hermes-style tools: listed in a system turn; a call is <tool_call>{"name": ..., "arguments": {...}}</tool_call>
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nYou may call these functions. To call one, answer with "
    "<tool_call>{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}</tool_call>.\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, "
    "\"arguments\": {% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (what the ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def build(vocab_size: int) -> PreTrainedTokenizerFast:
    alphabet = byte_alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL)}
    for b in range(256):
        if b not in NEVER_IN_UTF8:
            vocab[alphabet[b]] = len(vocab)
    order = [alphabet[ord(c)] for c in " etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLCUMWFGYPBVKJXQZ0123456789.,'-!?:;\"()"]
    pairs = sorted(itertools.product(order, repeat=2), key=lambda p: (order.index(p[0]) + order.index(p[1]), order.index(p[0])))
    triples = sorted(((a + b, c) for a, b, c in itertools.product(order, repeat=3)),
                     key=lambda p: sum(order.index(ch) for ch in p[0] + p[1]))
    merges = []
    for left, right in itertools.chain(pairs, triples):
        if len(vocab) == vocab_size:
            break
        if left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append((left, right))
    if len(vocab) != vocab_size:
        raise ValueError(f"cannot fill a vocabulary of {vocab_size}")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   chat_template=CHAT_TEMPLATE, model_max_length=1 << 20)


def main() -> None:
    sizes = sorted({json.loads(p.read_text())["vocab_size"] for p in (ROOT / "models" / "configs").glob("*.json")})
    for size in sizes:
        out = ROOT / "models" / "tokenizers" / f"vocab-{size}"
        build(size).save_pretrained(out)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
