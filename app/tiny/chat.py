"""The tiny tokenizers' special tokens (same ids in every corpus) and their ChatML template."""

PAD, IM_START, IM_END, MASK, UNK, BOS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|mask|>",
    "<unk>",
    "<|bos|>",
)
SPECIAL_TOKENS = [PAD, IM_START, IM_END, MASK, UNK, BOS]
ROLE_WORDS = ["system", "user", "assistant"]

# ChatML, as Qwen uses it (no generation markers: the loss mask comes from prefix rendering).
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
