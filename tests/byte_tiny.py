"""A tiny Llama whose tokenizer has one token per byte (GPT-2's byte-level alphabet, no merges): any text, JSON
included, is some sequence of its tokens, so structured outputs can hold a random model to any grammar.

    path = save_byte_model(tmp_path)           # vocab 259: <s> </s> <pad> + 256 bytes; a chat template
    save_byte_model(tmp_path, template=T, added=["[TOOL_CALLS]"])   # another template; special tokens after the bytes
"""
from __future__ import annotations

from tiny import save_tiny

SPECIALS = ("<s>", "</s>", "<pad>")
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def save_byte_tokenizer(path, template: str = TEMPLATE, added=()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for byte, char in sorted(bytes_to_unicode().items()):
        vocab[char] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if added:
        fast.add_special_tokens({"additional_special_tokens": list(added)})
    fast.chat_template = template
    fast.save_pretrained(path)
    return path


def save_byte_model(path, template: str = TEMPLATE, added=(), **overrides):
    overrides = {"vocab_size": len(SPECIALS) + 256 + len(added), "bos_token_id": 0, "eos_token_id": 1,
                 "pad_token_id": 2, "max_position_embeddings": 512, "initializer_range": 0.2, **overrides}
    return save_byte_tokenizer(save_tiny("LlamaForCausalLM", path, **overrides), template, added)
